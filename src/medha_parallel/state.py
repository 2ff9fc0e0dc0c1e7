"""Process groups for a TP x SPP x KVP layout, created the same way on every rank."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from medha_parallel.layout import Coords, ParallelLayout


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
        if self.backend == "nccl":
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
        timeout_s: float = 60.0,
    ) -> ParallelState:
        """Join (or reuse) the default process group and build every group.

        ``init_method`` is ``env://`` (torchrun), ``file://PATH`` or
        ``tcp://HOST:PORT``. The backend is NCCL when CUDA is available, gloo
        otherwise. ``timeout_s`` bounds every collective.
        """
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
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
        state = cls(layout=layout, rank=dist.get_rank(), backend=backend, timeout=timeout)
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
