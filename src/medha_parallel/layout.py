"""Which rank does what: tensor (tp), stream-pipeline (spp) and KV-cache (kvp) parallelism.

Pure Python. Ranks are laid out TP innermost, then KVP, then the SPP stage::

    rank = tp + TP * (kvp + KVP * spp)

so a TP group is a run of consecutive ranks, a KVP group holds one rank per
KVP replica at the same (tp, spp), and a pipeline holds one rank per stage at
the same (tp, kvp). Layer ``l`` lives on the same stage in every KVP replica,
so a layer's KVP merge stays inside one stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Coords(NamedTuple):
    """A rank's position: TP rank, pipeline stage, KVP group."""

    tp: int
    spp: int
    kvp: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelLayout:
    """Degrees of TP, SPP and KVP; ``world_size = tp * spp * kvp``."""

    tp: int = 1
    spp: int = 1
    kvp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "spp", "kvp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.spp * self.kvp

    def check_world_size(self, world_size: int) -> None:
        """Raise unless the degrees multiply to ``world_size``."""
        if world_size != self.world_size:
            raise ValueError(
                f"tp={self.tp} x spp={self.spp} x kvp={self.kvp} = {self.world_size} "
                f"does not match world_size={world_size}"
            )

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")
        tp, rest = rank % self.tp, rank // self.tp
        return Coords(tp=tp, spp=rest // self.kvp, kvp=rest % self.kvp)

    def rank(self, *, tp: int, spp: int, kvp: int) -> int:
        for name, value, degree in (
            ("tp", tp, self.tp),
            ("spp", spp, self.spp),
            ("kvp", kvp, self.kvp),
        ):
            if not 0 <= value < degree:
                raise ValueError(f"{name}={value} is outside 0..{degree - 1}")
        return tp + self.tp * (kvp + self.kvp * spp)

    def tp_groups(self) -> list[list[int]]:
        """Ranks sharing (spp, kvp), in TP order."""
        return [
            [self.rank(tp=t, spp=s, kvp=k) for t in range(self.tp)]
            for s in range(self.spp)
            for k in range(self.kvp)
        ]

    def spp_groups(self) -> list[list[int]]:
        """Pipelines: ranks sharing (tp, kvp), in stage order."""
        return [
            [self.rank(tp=t, spp=s, kvp=k) for s in range(self.spp)]
            for k in range(self.kvp)
            for t in range(self.tp)
        ]

    def kvp_groups(self) -> list[list[int]]:
        """Ranks sharing (tp, spp), in KVP-group order."""
        return [
            [self.rank(tp=t, spp=s, kvp=k) for k in range(self.kvp)]
            for s in range(self.spp)
            for t in range(self.tp)
        ]

    def kvp_prefix_groups(self, size: int) -> list[list[int]]:
        """The first ``size`` members of every KVP group (progressive KVP)."""
        if not 1 <= size <= self.kvp:
            raise ValueError(f"prefix size {size} is outside 1..{self.kvp}")
        return [g[:size] for g in self.kvp_groups()]
