"""CPU weights and KV cache on transparent huge pages, and ``MEDHA_CPU_HUGE_PAGES=off``."""

from __future__ import annotations

import os

import pytest
import torch

from medha_runtime import LLM, SamplingParams, huge_pages
from medha_runtime.model import load_model
from medha_runtime.runner import allocate_kv
from medha_sched import AffineCostModel

COST = AffineCostModel(base=1e-3, per_token=1e-5, per_attn=1e-9)


def _probe() -> tuple[bool, bool]:
    """(an arena can be made, its pages come back huge): the THP mode only allows huge
    pages; a process with THP disabled (``prctl``), fragmented memory or a cgroup can
    still get 4 KB pages, so the smaps checks below ask this probe, not the mode."""
    os.environ.pop(huge_pages.ENV, None)
    arena = huge_pages.new_arena(huge_pages.HUGE_PAGE)
    if arena is None:
        return False, False
    t = arena.empty((huge_pages.HUGE_PAGE,), torch.uint8)
    t.fill_(1)
    return True, huge_pages.huge_page_bytes(t) >= huge_pages.HUGE_PAGE


ARENA, GRANTED = _probe()
# where memory outside an arena is never huge: the off switch is visible in smaps (not
# under THP mode always, nor with torch's or glibc's own huge-page allocation switched on)
PLAIN_NEVER_HUGE = (
    GRANTED
    and huge_pages.thp_mode() == "madvise"
    and os.environ.get("THP_MEM_ALLOC_ENABLE", "0") in ("", "0")
    and "hugetlb" not in os.environ.get("GLIBC_TUNABLES", "")
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(huge_pages.ENV, raising=False)  # the default


@pytest.fixture
def off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(huge_pages.ENV, "off")


def test_switch_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(huge_pages.ENV, raising=False)
    assert huge_pages.enabled()
    monkeypatch.setenv(huge_pages.ENV, "on")
    assert huge_pages.enabled()
    monkeypatch.setenv(huge_pages.ENV, "off")
    assert not huge_pages.enabled()
    assert huge_pages.new_arena(1 << 20) is None
    assert huge_pages.zeros(2, (4, 4), torch.float32) is None
    monkeypatch.setenv(huge_pages.ENV, "yes")
    with pytest.raises(ValueError, match="'yes'"):
        huge_pages.enabled()


def test_thp_mode_reads_the_bracketed_choice(tmp_path, monkeypatch, on) -> None:
    f = tmp_path / "enabled"
    f.write_text("always madvise [never]\n")
    assert huge_pages.thp_mode(str(f)) == "never"
    f.write_text("always [madvise] never\n")
    assert huge_pages.thp_mode(str(f)) == "madvise"
    assert huge_pages.thp_mode(str(tmp_path / "missing")) is None
    # a kernel with THP off (or none): no arena, callers fall back
    monkeypatch.setattr(huge_pages, "THP_ENABLED", str(tmp_path / "never"))
    (tmp_path / "never").write_text("always madvise [never]\n")
    assert huge_pages.new_arena(1 << 20) is None
    monkeypatch.setattr(huge_pages, "THP_ENABLED", str(tmp_path / "missing"))
    assert huge_pages.new_arena(1 << 20) is None


def test_arena_packs_aligned_tensors_on_huge_pages(on) -> None:
    specs = [((3, 5), torch.float32), ((7,), torch.float64), ((1000, 1000), torch.float32)]
    arena = huge_pages.new_arena(huge_pages.packed_bytes(specs))
    if not ARENA:  # no THP to ask for: callers get None and allocate as before
        assert arena is None
        return
    assert arena is not None
    assert arena.address % huge_pages.HUGE_PAGE == 0
    ts = [arena.empty(shape, dtype) for shape, dtype in specs]
    starts = [t.data_ptr() for t in ts]
    assert starts[0] == arena.address
    assert all(p % huge_pages.ALIGN == 0 for p in starts)
    for t, (shape, dtype) in zip(ts, specs, strict=True):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        t.fill_(1.5)
    # no overlap: each still holds what was written to it
    ts[0].fill_(-2.0)
    assert ts[1].eq(1.5).all() and ts[2].eq(1.5).all() and ts[0].eq(-2.0).all()
    if GRANTED:
        assert huge_pages.huge_page_bytes(ts[2]) >= huge_pages.HUGE_PAGE
    with pytest.raises(ValueError, match="left"):
        arena.empty((1 << 20,), torch.float32)
    # the tensor keeps the mapping alive after the arena object is gone
    keep = ts[2]
    del arena, ts
    assert keep.eq(1.5).all()


def _tiny_kv():
    """A 512-block KV cache of tiny's shape (4 layers of ``[512, 16, 2, 16]`` fp32)."""
    return allocate_kv(
        num_layers=4,
        num_blocks=512,
        block_size=16,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.float32,
        device="cpu",
    )


def test_weights_and_kv_on_huge_pages_equal_the_normal_load(monkeypatch) -> None:
    monkeypatch.setenv(huge_pages.ENV, "off")
    plain, _ = load_model("tiny")
    plain_kv = _tiny_kv()
    monkeypatch.setenv(huge_pages.ENV, "on")
    huge, _ = load_model("tiny")
    kv = _tiny_kv()
    got, want = dict(huge.named_parameters()), dict(plain.named_parameters())
    assert got.keys() == want.keys()
    for name, p in got.items():
        assert torch.equal(p, want[name]), name
        assert p.data_ptr() != want[name].data_ptr()
        if GRANTED:
            assert huge_pages.huge_page_bytes(p) > 0, name
        if PLAIN_NEVER_HUGE:
            assert huge_pages.huge_page_bytes(want[name]) == 0, name
    # the tied head is the embedding, still one tensor
    assert huge.lm_head.weight.data_ptr() == huge.embed_tokens.weight.data_ptr()
    assert kv.num_layers == 4 and kv.num_blocks == 512
    ptrs = set()
    for t, ref in zip(kv.k + kv.v, plain_kv.k + plain_kv.v, strict=True):
        assert t.shape == ref.shape == (512, 16, 2, 16) and t.dtype == ref.dtype
        assert not t.any()
        if GRANTED:
            assert huge_pages.huge_page_bytes(t) >= huge_pages.HUGE_PAGE
        if PLAIN_NEVER_HUGE:
            assert huge_pages.huge_page_bytes(ref) == 0
        ptrs.add(t.data_ptr())
    assert len(ptrs) == 8
    if ARENA:  # one arena: layer i's K, then its V, then layer i + 1's K
        assert kv.v[0].data_ptr() - kv.k[0].data_ptr() == kv.k[0].numel() * 4
    kv.k[1].fill_(3.0)  # layers do not share memory
    assert not kv.k[0].any() and not kv.v[1].any() and kv.k[1].eq(3.0).all()


def _greedy() -> list[list[int]]:
    prompts = ["Hello", "Medha on huge pages", "x" * 40]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM("tiny", cost_model=COST, max_model_len=256) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_greedy_tokens_equal_with_the_switch_off(monkeypatch) -> None:
    monkeypatch.setenv(huge_pages.ENV, "off")
    want = _greedy()
    monkeypatch.setenv(huge_pages.ENV, "on")
    got = _greedy()
    assert got == want
    assert all(len(t) == 12 for t in got)
