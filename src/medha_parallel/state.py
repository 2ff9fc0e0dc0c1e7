"""Process groups for a TP x SPP x KVP layout, created the same way on every rank."""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from medha_parallel.layout import Coords, ParallelLayout

#: the automatic backend on a CUDA machine: CPU tensors through gloo, CUDA tensors through NCCL
MIXED_BACKEND = "cpu:gloo,cuda:nccl"


def resolve_backend(
    backend: str | None, device: str | torch.device | None, *, cuda_available: bool
) -> tuple[str, torch.device]:
    """The process-group backend and the state's device for ``initialize``'s arguments.

    ``backend`` None picks :data:`MIXED_BACKEND` where CUDA is available (so a
    group's collectives work on CPU tensors too, as torch.distributed users
    expect), else ``"gloo"``. ``device`` None is CUDA where the backend names
    NCCL and CUDA is available, else the CPU. A device the backend cannot
    carry (CPU on ``"nccl"``, CUDA on ``"gloo"`` or without CUDA) is a
    ``ValueError``.
    """
    if backend is None:
        backend = MIXED_BACKEND if cuda_available else "gloo"
    elif not isinstance(backend, str) or not backend:
        raise ValueError(f"backend must be a torch.distributed backend name, got {backend!r}")
    name = backend.lower()
    carries_cpu = name != "nccl" and (":" not in name or "cpu:" in name)
    carries_cuda = name != "gloo" and (":" not in name or "cuda:" in name)
    if device is None:
        device = "cuda" if ("nccl" in name or "cuda:" in name) and cuda_available else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if dev.type == "cpu" and not carries_cpu:
        raise ValueError(f"device 'cpu' needs a backend that carries CPU tensors, got {backend!r}")
    if dev.type == "cuda" and not (carries_cuda and cuda_available):
        why = "CUDA is not available" if not cuda_available else f"backend {backend!r} has no CUDA"
        raise ValueError(f"device {str(device)!r} cannot be used: {why}")
    return backend, dev


@dataclass
class ParallelState:
    """This rank's view of the layout and its process groups.

    Create with :meth:`initialize`. Every group of every kind is created on
    every rank, in one fixed order (TP groups, pipelines, KVP groups, then KVP
    prefix subgroups of sizes 2..kvp), because ``new_group`` is collective.
    """

    layout: ParallelLayout
    rank: int
    backend: str
    timeout: datetime.timedelta
    device_type: str = "cpu"
    tp_group: dist.ProcessGroup | None = None
    spp_group: dist.ProcessGroup | None = None
    kvp_group: dist.ProcessGroup | None = None
    kvp_prefix: dict[int, dist.ProcessGroup | None] = field(default_factory=dict)
    ranks: dict[str, list[int]] = field(default_factory=dict)

    @property
    def coords(self) -> Coords:
        return self.layout.coords(self.rank)

    @property
    def device(self) -> torch.device:
        """Where this rank's communicated tensors live (``cuda`` is the current device)."""
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @classmethod
    def initialize(
        cls,
        layout: ParallelLayout,
        *,
        init_method: str = "env://",
        rank: int | None = None,
        world_size: int | None = None,
        backend: str | None = None,
        device: str | torch.device | None = None,
        timeout_s: float = 60.0,
    ) -> ParallelState:
        """Join (or reuse) the default process group and build every group.

        ``init_method`` is ``env://`` (torchrun), ``file://PATH`` or
        ``tcp://HOST:PORT``. The backend defaults to ``cpu:gloo,cuda:nccl``
        when CUDA is available (CPU tensors still go through gloo), gloo
        otherwise; ``device`` (``cpu`` or ``cuda``; default: CUDA when the
        backend carries it and CUDA is available) is where the state's own
        buffers (pipeline headers and receive buffers) live. Pass
        ``backend="gloo"`` or ``device="cpu"`` for CPU ranks on any machine
        (several ranks on one GPU cannot use NCCL). ``timeout_s`` bounds every
        collective.
        """
        backend, dev = resolve_backend(backend, device, cuda_available=torch.cuda.is_available())
        finite = isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
        if not (finite and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
        timeout = datetime.timedelta(seconds=timeout_s)
        if not dist.is_initialized():
            if init_method == "env://":
                rank = int(os.environ["RANK"]) if rank is None else rank
                world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
            if world_size is not None:
                layout.check_world_size(world_size)
            dist.init_process_group(
                backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
            )
        layout.check_world_size(dist.get_world_size())
        state = cls(
            layout=layout,
            rank=dist.get_rank(),
            backend=backend,
            timeout=timeout,
            device_type=dev.type,
        )
        state._build_groups()
        return state

    def _build_groups(self) -> None:
        me = self.rank
        kinds = (
            ("tp", self.layout.tp_groups()),
            ("spp", self.layout.spp_groups()),
            ("kvp", self.layout.kvp_groups()),
        )
        for kind, groups in kinds:
            for ranks in groups:
                pg = dist.new_group(ranks, timeout=self.timeout)
                if me in ranks:
                    setattr(self, f"{kind}_group", pg)
                    self.ranks[kind] = ranks
        for size in range(2, self.layout.kvp + 1):
            for ranks in self.layout.kvp_prefix_groups(size):
                pg = dist.new_group(ranks, timeout=self.timeout)
                if me in ranks:
                    self.kvp_prefix[size] = pg
                    self.ranks[f"kvp{size}"] = ranks

    def destroy(self) -> None:
        """Tear down every process group (the default one included)."""
        if dist.is_initialized():
            dist.destroy_process_group()
