"""3D parallelism on 4 gloo ranks: TP2xSPP2, TP2xKVP2 and SPP2xKVP2 equal the oracle.

The toy transformer runs a 26-token sequence as three 8-token prompt chunks
and two single-token decodes. KVP groups hold 16 tokens each, so the context
grows from one group to two mid-sequence; the tail group appends new KV and
attends causally, the earlier one attends to its whole shard, and partial
states are merged. Every layout's final hidden states must match the
single-process forward over the whole sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from medha_parallel import (
    ChunkMeta,
    KVPCommunicator,
    ParallelLayout,
    ParallelState,
    SPPCommunicator,
    TPCommunicator,
    kvp_attention,
)

from .dist import launch
from .toy import KVCache, ToyConfig, ToyModel, _rms_norm, make_tokens, stage_ranges

CFG = ToyConfig(n_layers=4, n_heads=2, d_model=16, d_ff=32)
STEPS = [(0, 8), (8, 8), (16, 8), (24, 1), (25, 1)]  # (start, tokens): chunks, then decodes
GROUP_TOKENS = 16  # KVP shard size: positions [0, 16) on group 0, [16, 32) on group 1
LAYOUTS = {"tp2_spp2": (2, 2, 1), "tp2_kvp2": (2, 1, 2), "spp2_kvp2": (1, 2, 2)}


class Rank:
    """One rank's share of the toy model under a TP x SPP x KVP layout."""

    def __init__(self, model: ToyModel, state: ParallelState) -> None:
        self.model, self.state, self.c = model, state, state.coords
        lay = state.layout
        self.tp = TPCommunicator(state)
        self.kvp = KVPCommunicator(state) if lay.kvp > 1 else None
        self.spp = SPPCommunicator(state) if lay.spp > 1 else None
        self.layers = stage_ranges(CFG.n_layers, lay.spp)[self.c.spp]
        self.heads = CFG.n_heads // lay.tp
        self.shard = KVCache()  # this rank's heads, this KVP group's positions
        self.chunks = 0  # chunks this pipeline has carried (a group may join mid-sequence)

    def cols(self, width: int) -> slice:
        return slice(self.c.tp * width, (self.c.tp + 1) * width)

    def layer(self, layer: int, x: torch.Tensor, start: int) -> torch.Tensor:
        p, n, hd = self.model.layers[layer], x.shape[0], CFG.head_dim
        cols = self.cols(self.heads * hd)
        h = _rms_norm(x)
        q, k, v = ((h @ w[:, cols]).view(n, self.heads, hd) for w in (p.wq, p.wk, p.wv))
        o = self.attend(layer, q, k, v, start).reshape(n, self.heads * hd) @ p.wo[cols, :]
        x = x + self.tp.all_reduce(o)
        ff = self.cols(CFG.d_ff // self.state.layout.tp)
        return x + self.tp.all_reduce(F.silu(_rms_norm(x) @ p.w1[:, ff]) @ p.w2[ff, :])

    def attend(self, layer, q, k, v, start):
        if self.kvp is None:
            return self.shard.attend(layer, q, k, v, start)
        tail, g = start // GROUP_TOKENS, self.c.kvp
        if g == tail:  # the tail appends the chunk's KV
            ks, vs = self.shard.k.get(layer), self.shard.v.get(layer)
            self.shard.k[layer] = k if ks is None else torch.cat([ks, k])
            self.shard.v[layer] = v if vs is None else torch.cat([vs, v])
        out, _ = kvp_attention(
            q,
            self.shard.k[layer],
            self.shard.v[layer],
            comm=self.kvp,
            active=tail + 1,
            is_tail=g == tail,
            q_offset_local=start - g * GROUP_TOKENS,
            backend="torch",
        )
        return out

    def step(self, tokens: torch.Tensor, start: int) -> torch.Tensor | None:
        """Run one chunk through this rank's stage; returns the output on the last stage."""
        if self.kvp is not None and self.c.kvp > start // GROUP_TOKENS:
            return None  # this KVP group holds none of the sequence yet
        meta = ChunkMeta(seq_id=0, chunk_idx=self.chunks, start_pos=start, num_tokens=len(tokens))
        self.chunks += 1
        if self.spp is None or self.spp.is_first:
            x = self.model.embed(tokens, start)
        else:
            _, got = self.spp.recv_chunk()
            x = got["h"]
        for layer in self.layers:
            x = self.layer(layer, x, start)
        if self.spp is not None and not self.spp.is_last:
            self.spp.send_chunk(meta, {"h": x})
            return None
        return x


def _run_layouts(rank: int, world_size: int, init: str) -> dict:
    model, tokens = ToyModel(CFG), make_tokens(26)
    oracle = model.forward_full(tokens)
    results = {}
    for name, (tp, spp, kvp) in LAYOUTS.items():
        state = ParallelState.initialize(
            ParallelLayout(tp=tp, spp=spp, kvp=kvp),
            backend="gloo",
            init_method=init,
            rank=rank,
            world_size=world_size,
            timeout_s=60,
        )
        me = Rank(model, state)
        outs = {}
        for start, n in STEPS:
            out = me.step(tokens[start : start + n], start)
            if out is not None:
                outs[start] = out
        if me.spp is not None:
            me.spp.drain()
        errs = {s: (o - oracle[s : s + o.shape[0]]).abs().max().item() for s, o in outs.items()}
        results[name] = {"coords": tuple(state.coords), "errors": errs}
    return results


def test_3d_layouts_match_the_single_process_oracle() -> None:
    results = launch(_run_layouts, 4, timeout=180)
    for name, (tp, spp, kvp) in LAYOUTS.items():
        layout = ParallelLayout(tp=tp, spp=spp, kvp=kvp)
        covered: set[int] = set()
        for rank, res in enumerate(results):
            r = res[name]
            assert r["coords"] == tuple(layout.coords(rank))
            for start, err in r["errors"].items():
                assert err < 1e-5, f"{name} rank {rank} step at {start}: error {err:.2e}"
                covered.add(start)
            if r["coords"][1] == spp - 1:  # the last stage outputs every step its group is in
                group = r["coords"][2]
                joined = {s for s, _ in STEPS if kvp == 1 or s // GROUP_TOKENS >= group}
                assert set(r["errors"]) == joined, (name, rank, r["errors"])
        assert covered == {s for s, _ in STEPS}, f"{name}: some steps never produced output"
