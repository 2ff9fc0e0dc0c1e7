"""The engine's configuration, :class:`EngineConfig`, resolved once into :class:`ResolvedEngine`.

``LLM``, the server (``medha-runtime serve``) and the CLI build one
:class:`EngineConfig`; :class:`~medha_runtime.engine.LLMEngine` takes it and
resolves it once, against the model's config, into a :class:`ResolvedEngine`
(the layout, dtype, device, context length, KV cache sizing, scheduler
config, runner spec and thread count)::

    from medha_runtime import EngineConfig, LLM

    llm = LLM(EngineConfig(model="tiny", kvp=2, num_threads=1))
    llm = LLM("tiny", kvp=2, num_threads=1)  # the same

This module imports no torch at its top: the server's HTTP process imports
it to describe the engine it starts.
"""

from __future__ import annotations

import math
import os
import platform
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from medha_runtime.dist_config import DistConfig, check_int
from medha_sched import CacheConfig, ParallelDegrees, SchedulerConfig

if TYPE_CHECKING:
    from medha_runtime.model import ModelConfig
    from medha_runtime.runner import RunnerSpec
    from medha_sched import CostModel

_GIB = 1 << 30
#: ``LLM``'s default ``throughput_chunk``: a 2,048-token chunk runs the
#: products at full rate on a CPU (see docs/benchmarks.md, "Batch 32 and the
#: 2,048-token prefill")
OFFLINE_THROUGHPUT_CHUNK = 2048
#: dtype aliases and the canonical name each stands for
DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
}
DTYPES = ("auto", "float32", "float16", "bfloat16", *DTYPE_ALIASES)


def canonical_dtype(name: str) -> str:
    """The canonical name of a dtype name or alias (``"bf16"`` -> ``"bfloat16"``,
    ``"torch.float16"`` -> ``"float16"``; ``"auto"`` stays); another text is returned as
    is (:class:`EngineConfig` refuses it)."""
    name = name.removeprefix("torch.")
    return DTYPE_ALIASES.get(name, name)


#: ``attention_backend`` values: "auto" and ``medha_kernels.backends.BACKENDS`` (named here
#: because this module imports no torch)
ATTENTION_BACKENDS = ("auto", "torch", "triton", "native", "flashinfer")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Everything that decides how the engine is built (frozen, validated on creation).

    Attributes:
        model: a local Hugging Face model directory, a ``.gguf`` file,
            ``"smollm2"`` (SmolLM2-135M-Instruct, fetched once into the Medha
            cache), a hub id in the local Hugging Face cache, or ``"tiny"``
            (the built-in model with RANDOM weights: its text is gibberish).
            See :mod:`medha_runtime.model.names`.
        dtype: ``"auto"`` (the checkpoint's), ``"float32"``, ``"bfloat16"``,
            ``"float16"`` (or a ``torch.dtype``, stored by name).
        tp: tensor-parallel degree (divides the KV heads).
        spp: stream-pipeline stages (at most the number of layers).
        kvp: KV-parallel groups; a request longer than ``kvp_group_tokens``
            spreads its KV over several groups.
        kvp_group_tokens: most tokens of one request one KVP group holds
            (a multiple of ``block_size``); default: the context over ``kvp``.
            Small values force sharding with short prompts.
        policy: scheduling policy (``lars-mp``, ``lars``, ``edf``, ``lrs``,
            ``srpt``, ``fcfs``).
        target_batch_time: iteration-time budget in seconds (adaptive chunking).
            Default: 50 ms, raised to twice the predicted time of one
            ``token_grid`` chunk at the end of the context when that is more
            (so the longest prompt stays schedulable on slow devices).
        chunk_size: a fixed per-batch token budget instead of adaptive chunking
            (``0``: whole prompts).
        throughput_chunk: when the budget is automatic (``target_batch_time``
            and ``chunk_size`` unset), also raise it so that one prefill chunk
            of this many tokens at the start of a prompt fits it with 10% to
            spare. Offline work wants throughput, and every chunk re-reads the
            weights: :class:`~medha_runtime.LLM` defaults this to
            :data:`OFFLINE_THROUGHPUT_CHUNK`. The server leaves it unset, so
            decode latency stays bounded by the 50 ms default.
        token_grid: chunk sizes are multiples of this (scheduler default 32).
        max_batch_requests: most requests per batch.
        max_model_len: longest prompt plus output (default: the model's
            ``max_position_embeddings``, limited by the KV cache).
        kv_cache_tokens: KV tokens in each KVP group's pool (default: what
            fits in device memory, :func:`kv_budget_bytes`, but at most twice
            one request's share of the group, ``kvp_group_tokens``, or 16,384
            tokens where that is more: room for a few requests of the whole
            context; give more here to hold more requests at once).
        block_size: tokens per KV block.
        seed: seeds requests that give no ``seed`` of their own.
        cost_model: a ``medha_sched`` cost model or spec string
            (``"affine:base=...,per_token=...,per_attn=..."``,
            ``"table:PATH"`` from ``medha-runtime profile``, ``"online"``);
            default (None or ``"online"``): an affine model calibrated with a
            few synthetic steps at start-up, then learned from every step.
        cost_model_out: save the online cost model's state here at shutdown.
        device: ``"cpu"`` or ``"cuda"`` (default: CUDA when available).
        timeout_s: bound on every collective between workers.
        attention_backend: the ``medha_kernels`` attention backend of every layer
            (``"auto"``, ``"torch"``, ``"triton"``, ``"native"``, ``"flashinfer"``).
        num_threads: torch CPU threads per rank (default: the node's cores
            divided by the ranks on it; in-process, torch's own setting).
        enable_prefix_caching: reuse the KV of a prompt prefix another request
            already computed (read by the prefix cache).
        step_log: write every batch's timings and work to this JSON-lines
            file (see :mod:`medha_runtime.step_log`).
        distributed: a :class:`~medha_runtime.dist_config.DistConfig` for a
            multi-node or torchrun run (this process becomes rank 0, the driver).
        async_scheduling: form and ship batch N+1 while the model runs batch N
            (a running request's next decode is issued before its previous
            token is back; the model takes that token itself). Outputs are the
            same; the driver's serial work between batches is hidden. Any tp
            and kvp, in process, on worker processes or distributed (the
            sampling rank sends each step's tokens to every rank). With spp > 1
            (worker processes on one host only: the torch.distributed executor
            refuses it) a decode is issued once the previous batch cleared
            stage 0, and the last stage sends its tokens straight to stage 0
            through shared memory. None (auto, the default): on with spp > 1
            on one host (where it takes the driver's round trip off each
            decode token's path), off otherwise.
        generation_config: where requests' unset sampling fields come from
            (vLLM's ``--generation-config``): ``"auto"`` (default), the model
            directory's ``generation_config.json`` (``temperature``, ``top_p``,
            ``top_k``, ``min_p``, ``repetition_penalty``, ``max_new_tokens``);
            ``"vllm"``, none of it; or a directory holding such a file. See
            :mod:`medha_runtime.generation_defaults`.
        chat_template: the chat template to use instead of the model's (vLLM's
            ``--chat-template``): a Jinja file's path, or the Jinja text itself.
            Read and compiled when the config is made.
        cuda_graphs: replay decode-only steps from CUDA graphs, one per padded
            batch size (see :mod:`medha_runtime.decode_graphs`): tp = spp = kvp
            = 1 and the Triton attention backend (another backend leaves them
            off, with one warning). None (default): on for a CUDA device with
            one rank, else off. True on a CPU runs the same padded batches
            without graphs (what the tests check).
    """

    model: str = "tiny"
    dtype: str = "auto"
    tp: int = 1
    spp: int = 1
    kvp: int = 1
    kvp_group_tokens: int | None = None
    policy: str = "lars-mp"
    target_batch_time: float | None = None
    chunk_size: int | None = None
    throughput_chunk: int | None = None
    token_grid: int | None = None
    max_batch_requests: int | None = None
    max_model_len: int | None = None
    kv_cache_tokens: int | None = None
    block_size: int = 16
    seed: int = 0
    cost_model: CostModel | str | None = None
    cost_model_out: str | None = None
    device: str | None = None
    timeout_s: float = 60.0
    attention_backend: str = "auto"
    num_threads: int | None = None
    enable_prefix_caching: bool = True
    step_log: str | None = None
    distributed: DistConfig | None = None
    async_scheduling: bool | None = None
    cuda_graphs: bool | None = None
    chat_template: str | None = None
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.model, os.PathLike):
            object.__setattr__(self, "model", os.fspath(self.model))
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty name or path, got {self.model!r}")
        dtype = self.dtype
        if type(dtype).__module__ == "torch":  # a torch.dtype: keep its name
            dtype = str(dtype).removeprefix("torch.")
            object.__setattr__(self, "dtype", dtype)
        if not isinstance(dtype, str) or dtype.removeprefix("torch.") not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES[:4])}")
        for name in ("tp", "spp", "kvp", "block_size"):
            check_int(name, getattr(self, name), 1)
        check_int("seed", self.seed, 0)
        for name, minimum in (
            ("kvp_group_tokens", 1),
            ("chunk_size", 0),
            ("throughput_chunk", 1),
            ("token_grid", 1),
            ("max_batch_requests", 1),
            ("max_model_len", 2),
            ("num_threads", 1),
        ):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), minimum)
        if self.kv_cache_tokens is not None:
            check_int("kv_cache_tokens", self.kv_cache_tokens, self.block_size)
        if self.kvp_group_tokens is not None and self.kvp_group_tokens % self.block_size:
            raise ValueError(
                f"kvp_group_tokens={self.kvp_group_tokens} must be a multiple of "
                f"block_size={self.block_size}"
            )
        if self.target_batch_time is not None and not _positive_number(self.target_batch_time):
            raise ValueError(
                f"target_batch_time must be a number > 0, got {self.target_batch_time!r}"
            )
        if not _positive_number(self.timeout_s) or not math.isfinite(self.timeout_s):
            raise ValueError(  # no None, no inf: every collective between workers is bounded
                f"timeout_s must be a finite number > 0, got {self.timeout_s!r}"
            )
        from medha_sched import available_policies

        if self.policy not in available_policies():
            raise ValueError(
                f"unknown policy {self.policy!r}; known: {', '.join(available_policies())}"
            )
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"unknown attention_backend {self.attention_backend!r}; known: "
                f"{', '.join(ATTENTION_BACKENDS)}"
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}"
            )
        for name in ("step_log", "cost_model_out"):
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                object.__setattr__(self, name, os.fspath(value))
            elif value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a path, got {value!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(
                f"async_scheduling must be True, False or None (auto), got "
                f"{self.async_scheduling!r}"
            )
        if self.cuda_graphs is not None and not isinstance(self.cuda_graphs, bool):
            raise ValueError(
                f"cuda_graphs must be True, False or None (auto), got {self.cuda_graphs!r}"
            )
        if self.cuda_graphs and self.world_size != 1:
            raise ValueError(
                f"cuda_graphs=True needs one rank (tp = spp = kvp = 1), got tp={self.tp}, "
                f"spp={self.spp}, kvp={self.kvp}"
            )
        if self.chat_template is not None:
            if isinstance(self.chat_template, os.PathLike):
                object.__setattr__(self, "chat_template", os.fspath(self.chat_template))
            from medha_runtime.tokenizer import read_chat_template

            read_chat_template(self.chat_template)  # a ChatTemplateError (a ValueError) names it
        if isinstance(self.generation_config, os.PathLike):
            object.__setattr__(self, "generation_config", os.fspath(self.generation_config))
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(
                "generation_config must be 'auto', 'vllm' or a directory, got "
                f"{self.generation_config!r}"
            )
        if self.generation_config not in ("auto", "vllm"):
            from medha_runtime.generation_defaults import generation_defaults

            generation_defaults(self.generation_config, None)  # names a bad file or value
        if self.distributed is not None and not isinstance(self.distributed, DistConfig):
            raise ValueError(f"distributed must be a DistConfig, got {self.distributed!r}")
        if self.async_scheduling and self.spp != 1:
            why = _async_spp_obstacle(self)
            if why is not None:
                raise ValueError(why)
        if self.distributed is not None:
            world = self.tp * self.spp * self.kvp
            if self.distributed.world_size != world:
                raise ValueError(
                    f"the distributed world has {self.distributed.world_size} ranks but "
                    f"tp*spp*kvp = {self.tp}*{self.spp}*{self.kvp} = {world}"
                )

    @classmethod
    def build(
        cls, model: str | os.PathLike[str] | EngineConfig = "tiny", **kwargs: Any
    ) -> EngineConfig:
        """An :class:`EngineConfig` from ``model`` and keyword arguments (names checked).

        ``model`` may already be an :class:`EngineConfig` (then no keywords are allowed).
        """
        if isinstance(model, EngineConfig):
            if kwargs:
                raise ValueError(
                    f"pass either an EngineConfig or keyword arguments, not both "
                    f"(got {', '.join(sorted(kwargs))})"
                )
            return model
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"unknown engine argument(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        return cls(model=model, **kwargs)  # type: ignore[arg-type]

    @property
    def layout(self) -> ParallelDegrees:
        return ParallelDegrees(tp=self.tp, spp=self.spp, kvp=self.kvp)

    @property
    def world_size(self) -> int:
        return self.tp * self.spp * self.kvp

    def resolve(
        self, model_config: ModelConfig, *, model_path: str | Path | None = None
    ) -> ResolvedEngine:
        """Derive the engine's values for a model (see :func:`resolve_engine`)."""
        return resolve_engine(self, model_config, model_path=model_path)


@dataclass(frozen=True, kw_only=True)
class ResolvedEngine:
    """What an :class:`EngineConfig` means for one model on this machine, resolved once.

    Attributes:
        layout: the parallel degrees.
        dtype: the weights' and KV's dtype name (``"auto"`` resolved).
        device: ``"cpu"`` or ``"cuda"``.
        max_model_len: the context a request may use (prompt plus output).
        cache: the scheduler's KV cache sizing (blocks per KVP group, ``G``).
        scheduler_config: the scheduler's config; ``target_batch_time`` is the
            default until the engine raises it for the calibrated cost model
            (when the config gives none).
        spec: what every rank builds (:class:`~medha_runtime.runner.RunnerSpec`).
        num_threads: torch CPU threads of an in-process engine (None: torch's
            own); worker ranks use ``spec.num_threads`` or cores / local ranks.
        chat_template: the Jinja source that replaces the model's chat template
            (``EngineConfig.chat_template`` read), or None.
        sampling_defaults: ``{SamplingParams field: value}`` for the fields a request
            leaves unset (``EngineConfig.generation_config`` read).
    """

    layout: ParallelDegrees
    dtype: str
    device: str
    max_model_len: int
    cache: CacheConfig
    scheduler_config: SchedulerConfig
    spec: RunnerSpec
    num_threads: int | None
    chat_template: str | None = None
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)


def resolve_engine(
    config: EngineConfig, model_config: ModelConfig, *, model_path: str | Path | None = None
) -> ResolvedEngine:
    """Check ``config`` against the model and derive the context, KV pool and runner spec.

    Args:
        config: the engine config.
        model_config: the model's config (``load_model_info``).
        model_path: the resolved model path ranks load (default: ``config.model``).
    """
    import torch

    from medha_runtime.generation_defaults import generation_defaults
    from medha_runtime.model.config import dtype_name, resolve_dtype
    from medha_runtime.runner import RunnerSpec, kv_bytes_per_token
    from medha_runtime.tokenizer import read_chat_template

    c, m = config, model_config
    tp, spp, kvp, block = c.tp, c.spp, c.kvp, c.block_size
    torch_dtype = resolve_dtype(c.dtype, m)
    dtype = dtype_name(torch_dtype)
    local = c.world_size if c.distributed is None else c.distributed.local_ranks
    device = check_layout(m, tp=tp, spp=spp, device=c.device, local_ranks=local)

    # ---- context and KV memory
    limit = m.max_position_embeddings
    if c.max_model_len is not None and c.max_model_len > limit:
        raise ValueError(
            f"max_model_len={c.max_model_len} exceeds the model's max_position_embeddings={limit}"
        )
    want = c.max_model_len or limit
    if c.kvp_group_tokens is not None:
        group_tokens = c.kvp_group_tokens
    else:
        group_tokens = -(-math.ceil(want / kvp) // block) * block
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    if c.kv_cache_tokens is not None:
        pool = c.kv_cache_tokens
    else:
        per_token = kv_bytes_per_token(
            num_layers=m.num_layers,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            itemsize=itemsize,
            tp=tp,
            spp=spp,
        )
        budget = kv_budget_bytes(device, m, itemsize, c.world_size, tp * spp)
        pool = max(min(budget // per_token, max(2 * group_tokens, 16384)), block)
    num_blocks = pool // block
    capacity = num_blocks * block
    if group_tokens > capacity:
        if c.kvp_group_tokens is not None:
            raise ValueError(
                f"kvp_group_tokens={c.kvp_group_tokens} exceeds one KVP group's KV cache of "
                f"{capacity} tokens (kv_cache_tokens)"
            )
        group_tokens = capacity
    context = min(want, kvp * group_tokens)
    if c.max_model_len is not None and c.max_model_len > context:
        raise ValueError(
            f"max_model_len={c.max_model_len} does not fit: one request holds at most "
            f"{group_tokens} tokens on each of kvp={kvp} KVP groups ({context} tokens); "
            "raise kv_cache_tokens or kvp_group_tokens"
        )
    cache = CacheConfig(
        block_size=block,
        num_blocks_per_group=num_blocks,
        max_tokens_per_group=group_tokens,
        enable_prefix_caching=config.enable_prefix_caching,
    )
    return ResolvedEngine(
        layout=c.layout,
        dtype=dtype,
        device=device,
        max_model_len=context,
        cache=cache,
        scheduler_config=scheduler_config(c),
        spec=RunnerSpec(
            model=str(model_path if model_path is not None else c.model),
            dtype=dtype,
            device=device,
            tp=tp,
            spp=spp,
            kvp=kvp,
            num_blocks=num_blocks,
            block_size=block,
            group_tokens=group_tokens,
            attention_backend=c.attention_backend,
            timeout_s=c.timeout_s,
            num_threads=c.num_threads,
            pending_tokens=async_on(c),
            cuda_graph_max_batch=_graph_batch(c) if _graphs_on(c, device) else 0,
            max_model_len=context,
        ),
        num_threads=c.num_threads,
        chat_template=None if c.chat_template is None else read_chat_template(c.chat_template),
        sampling_defaults=generation_defaults(
            c.generation_config, _model_dir(model_path or c.model)
        ),
    )


def _model_dir(model: str | Path) -> str | None:
    """The model's Hugging Face directory (None: ``tiny``, a GGUF file, a random model)."""
    from medha_runtime.model.names import resolve_model

    if not Path(model).is_dir():
        return None
    resolved = resolve_model(str(model))
    return resolved.path if resolved.kind == "hf" else None


def check_layout(
    model_config: ModelConfig, *, tp: int, spp: int, device: str | None, local_ranks: int
) -> str:
    """Refuse a layout the model or this node cannot run (ValueError naming it) before any
    worker starts; returns the device (``"cpu"`` or ``"cuda"``)."""
    import torch

    from medha_runtime.runner import resolve_device

    m = model_config
    if m.num_kv_heads % tp or m.intermediate_size % tp:
        raise ValueError(
            f"tp={tp} must divide the model's {m.num_kv_heads} KV heads and its "
            f"intermediate size {m.intermediate_size}"
        )
    if spp > m.num_layers:
        raise ValueError(f"spp={spp} exceeds the model's {m.num_layers} layers")
    resolved = resolve_device(device)
    if resolved == "cuda" and local_ranks > torch.cuda.device_count():
        raise ValueError(
            f"{local_ranks} ranks on this node need as many GPUs; "
            f"{torch.cuda.device_count()} are visible"
        )
    return resolved


def async_on(config: EngineConfig) -> bool:
    """``async_scheduling``, or with None (auto): spp > 1 where nothing stands in its
    way (:func:`_async_spp_obstacle`)."""
    if config.async_scheduling is not None:
        return config.async_scheduling
    return config.spp > 1 and _async_spp_obstacle(config) is None


def _async_spp_obstacle(config: EngineConfig) -> str | None:
    """Why async scheduling cannot run with ``config``'s spp > 1, or None: the last
    stage sends its sampled ids to stage 0 through shared memory, so it needs worker
    processes on one host that can share memory, and a batch's ids in one message."""
    c = config
    from medha_parallel import shm
    from medha_parallel.tokens import SHM_MAX_IDS

    if not shm.supported():
        return (
            f"async_scheduling=True with spp={c.spp} needs shared memory between the ranks "
            f"(Linux on x86-64); this is {sys.platform} on {platform.machine()}"
        )
    if c.max_batch_requests is not None and c.max_batch_requests > SHM_MAX_IDS:
        return (
            f"async_scheduling=True with spp={c.spp} takes at most {SHM_MAX_IDS} requests "
            f"per batch, got max_batch_requests={c.max_batch_requests}"
        )
    if c.distributed is not None:
        return (
            f"async_scheduling=True with spp={c.spp} (tp={c.tp}, spp={c.spp}, kvp={c.kvp}) "
            "needs worker processes on one host (the last stage sends its tokens to stage 0 "
            "through shared memory); the torch.distributed executor (distributed=...) runs "
            "it with spp = 1 only"
        )
    return None


def _graphs_on(config: EngineConfig, device: str) -> bool:
    """``cuda_graphs``, or with None: a CUDA device and one rank."""
    if config.cuda_graphs is not None:
        return config.cuda_graphs
    return device == "cuda" and config.world_size == 1


def _graph_batch(config: EngineConfig) -> int:
    """The largest decode batch captured in a CUDA graph: the batch cap, at most 256."""
    return min(256, config.max_batch_requests or SchedulerConfig().max_batch_requests)


def scheduler_config(config: EngineConfig) -> SchedulerConfig:
    """The scheduler's config from the engine's (the scheduler's defaults where unset)."""
    kw: dict[str, Any] = {"policy": config.policy}
    if config.target_batch_time is not None:
        kw["target_batch_time"] = config.target_batch_time
    if config.chunk_size is not None:
        kw["chunk_size"] = config.chunk_size
    if config.token_grid is not None:
        kw["token_grid"] = config.token_grid
        kw["max_chunk_tokens"] = max(SchedulerConfig().max_chunk_tokens, config.token_grid)
    if config.max_batch_requests is not None:
        kw["max_batch_requests"] = config.max_batch_requests
    if async_on(config):
        kw["async_decodes"] = True
    return SchedulerConfig(**kw)


def kv_budget_bytes(
    device: str, config: ModelConfig, itemsize: int, world: int, shards: int
) -> int:
    """Default KV bytes per rank: most of a GPU after weights, a share of host memory on CPU."""
    c = config
    per_layer = (
        c.hidden_size * (c.num_q_heads + 2 * c.num_kv_heads) * c.head_dim
        + c.num_q_heads * c.head_dim * c.hidden_size
        + 3 * c.hidden_size * c.intermediate_size
    )
    weights = (c.num_layers * per_layer + 2 * c.vocab_size * c.hidden_size) * itemsize // shards
    if device == "cuda":
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
        return max(int(0.85 * total) - weights - 2 * _GIB, 64 << 20)
    try:
        phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        phys = 16 * _GIB
    return max(min(phys // (4 * world), 8 * _GIB), 64 << 20)


def _positive_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
