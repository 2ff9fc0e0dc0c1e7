"""Compare scheduling policies in the simulator before deploying them.

Two minutes of a mixed workload (10% long prompts of 128K-256K tokens, the
rest ShareGPT4-like chats) on Llama-3-8B served by 16 A100s as TP8 x SPP2,
priced by the roofline cost model. The real scheduler makes every decision;
the simulator replaces the GPUs by the predicted batch times.

    python examples/sim_policies.py
"""

from __future__ import annotations

from medha_sched import CacheConfig, ParallelDegrees, SchedulerConfig, parse_cost_model_spec
from medha_sched.sim import WorkloadSpec, generate, simulate, summarize

LAYOUT = ParallelDegrees(tp=8, spp=2)
MODEL = parse_cost_model_spec("roofline:model=llama3-8b,gpu=a100", layout=LAYOUT)
CACHE = CacheConfig(block_size=16, num_blocks_per_group=1 << 19)  # 8M tokens of KV
TRACE = generate(
    WorkloadSpec(qps=1.0, duration_s=120.0, long_fraction=0.1, seed=0, max_context=1 << 18)
)

POLICIES = {
    "FCFS, no chunking": SchedulerConfig(policy="fcfs", chunk_size=0),
    "FCFS, 512-token chunks": SchedulerConfig(policy="fcfs", chunk_size=512),
    "Medha (LARS + space sharing)": SchedulerConfig(policy="lars-mp", target_batch_time=0.05),
}


def main() -> None:
    n_long = sum(r.prompt_tokens >= 32768 for r in TRACE)
    print(f"{len(TRACE)} requests ({n_long} long), Llama-3-8B on 16 A100s (TP8 x SPP2)\n")
    print(f"{'policy':30} {'chat TTFT p50':>14} {'p90':>8} {'long TTFT p50':>14} {'TPOT p90':>9}")
    for name, config in POLICIES.items():
        result = simulate(TRACE, config, MODEL, cache=CACHE)
        s = summarize(result.records, result.iterations, long_threshold=32768, num_stages=2)
        short, long = s["ttft_s"]["short"], s["ttft_s"]["long"]  # type: ignore[index]
        tpot = s["tpot_s"]["all"]["p90"]  # type: ignore[index]
        print(
            f"{name:30} {short['p50']:>13.3f}s {short['p90']:>7.2f}s "
            f"{long['p50']:>13.1f}s {tpot * 1e3:>7.0f}ms"
        )


if __name__ == "__main__":
    main()
