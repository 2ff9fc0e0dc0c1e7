"""Drop Medha's scheduler into your own serving loop.

One 200K-token prompt arrives first, then a short chat every 50 ms. Your
executor is replaced here by the cost model's prediction. Under FCFS the
chats queue behind the long prefill (a convoy). Under LARS the long prefill
is chunked and preempted: a chat waits only until its relative slack falls
below the long request's (near its 0.5 s deadline), and with space sharing
(``lars-mp``) the long prefill yields part of every batch, so chats run at
once. The long request meets its own (derived) deadline in every case.

    python examples/sched_lars.py
"""

from __future__ import annotations

import statistics

from medha_sched import (
    AffineCostModel,
    BatchResult,
    CacheConfig,
    Request,
    Scheduler,
    SchedulerConfig,
)


def serve(policy: str) -> dict[str, float]:
    model = AffineCostModel(base=5e-3, per_token=4e-5, per_attn=2e-10)
    config = SchedulerConfig(policy=policy, target_batch_time=0.05)
    cache = CacheConfig(block_size=16, num_blocks_per_group=16_384)  # 256K tokens
    sched = Scheduler(config, model, cache=cache)
    arrivals = [Request("long", 0.0, 200_000, 16)]
    arrivals += [Request(f"chat{i}", 0.01 + 0.05 * i, 300, 16) for i in range(100)]
    first_token: dict[str, float] = {}
    now = 0.0
    while arrivals or sched.has_unfinished_requests():
        while arrivals and arrivals[0].arrival_time <= now:
            sched.add_request(arrivals.pop(0))
        batch = sched.schedule(now)  # a frozen ScheduleOutput: plain data
        if batch.is_empty:
            now = arrivals[0].arrival_time
            continue
        now += batch.predicted_time  # run it on your executor instead
        sampled = {c.request_id: 7 for c in batch.chunks if c.samples}
        for rid in sampled:
            first_token.setdefault(rid, now)
        sched.on_batch_end(batch.batch_id, BatchResult(sampled_token_ids=sampled))
    chats = sorted(first_token[f"chat{i}"] - (0.01 + 0.05 * i) for i in range(100))
    return {
        "chat_ttft_p50": statistics.median(chats),
        "chat_ttft_p90": chats[89],
        "long_ttft": first_token["long"],
    }


if __name__ == "__main__":
    print(f"{'policy':8} {'chat TTFT p50':>14} {'chat TTFT p90':>14} {'long TTFT':>10}")
    for policy in ("fcfs", "edf", "lars", "lars-mp"):
        r = serve(policy)
        print(
            f"{policy:8} {r['chat_ttft_p50']:>13.3f}s {r['chat_ttft_p90']:>13.3f}s "
            f"{r['long_ttft']:>9.2f}s"
        )
