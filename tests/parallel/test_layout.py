"""ParallelLayout: coordinates, groups and validation for every TP x SPP x KVP <= 8."""

from __future__ import annotations

import itertools

import pytest

from medha_parallel import ParallelLayout

LAYOUTS = [
    (tp, spp, kvp)
    for tp, spp, kvp in itertools.product(range(1, 9), repeat=3)
    if tp * spp * kvp <= 8
]


@pytest.mark.parametrize(("tp", "spp", "kvp"), LAYOUTS)
def test_groups_partition_the_world_and_are_orthogonal(tp, spp, kvp) -> None:
    layout = ParallelLayout(tp=tp, spp=spp, kvp=kvp)
    world = set(range(layout.world_size))
    for kind, degree in (("tp", tp), ("spp", spp), ("kvp", kvp)):
        groups = getattr(layout, f"{kind}_groups")()
        flat = [r for g in groups for r in g]
        assert sorted(flat) == sorted(world), f"{kind} groups do not partition the world"
        assert all(len(g) == degree for g in groups)
        for g in groups:  # members differ only in this dimension
            coords = [layout.coords(r) for r in g]
            assert [getattr(c, kind) for c in coords] == list(range(degree))
            others = {tuple(v for f, v in c._asdict().items() if f != kind) for c in coords}
            assert len(others) == 1
    for rank in world:
        c = layout.coords(rank)
        assert layout.rank(tp=c.tp, spp=c.spp, kvp=c.kvp) == rank
        assert rank % tp == c.tp  # TP innermost
    for size in range(1, kvp + 1):
        prefixes = layout.kvp_prefix_groups(size)
        assert all(p == g[:size] for p, g in zip(prefixes, layout.kvp_groups(), strict=True))


def test_world_size_mismatch_names_the_values() -> None:
    with pytest.raises(ValueError, match=r"tp=2 x spp=2 x kvp=1 = 4 does not match world_size=3"):
        ParallelLayout(tp=2, spp=2).check_world_size(3)
    with pytest.raises(ValueError, match="kvp must be an integer >= 1, got 0"):
        ParallelLayout(kvp=0)
    with pytest.raises(ValueError, match=r"rank 8 is outside 0\.\.7"):
        ParallelLayout(tp=2, spp=2, kvp=2).coords(8)
