"""Tests for medha_sched.cost: affine, roofline and table models, and the registry."""

from __future__ import annotations

import ast
import json
import math
import random
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from medha_sched.config import ParallelDegrees
from medha_sched.cost import (
    AffineCostModel,
    AggregateCostModel,
    BatchWork,
    CostModel,
    HardwareSpec,
    ModelShape,
    RequestWork,
    RooflineCostModel,
    TableCostModel,
    available_cost_models,
    create_cost_model,
    get_hardware,
    get_model_shape,
    parse_cost_model_spec,
    register_cost_model,
)
from medha_sched.cost import registry as registry_module

COST_DIR = Path(__file__).resolve().parents[2] / "src" / "medha_sched" / "cost"
P = ParallelDegrees
LLAMA8B, H100 = get_model_shape("llama3-8b"), get_hardware("h100")

AFFINE = AffineCostModel(base=3e-3, per_token=4e-5, per_attn=7.5e-10, layout=P(kvp=3))

# A hand-made profile whose rows' end slopes cross (row 2 is flatter than
# row 1 beyond the last kv point) and whose last column increments shrink, so
# the monotone extensions are exercised.
TABLE_DATA = {
    "version": 1,
    "layout": {"tp": 1, "spp": 1, "kvp": 2},
    "base_s": 1e-3,
    "linear": {"tokens": [1, 32, 512, 8192], "seconds": [5e-3, 5.5e-3, 1.2e-2, 1.3e-1]},
    "attention": {
        "q_tokens": [1, 16, 256, 4096],
        "kv_tokens": [0, 1000, 10000, 100000],
        "seconds": [
            [0.0, 1e-5, 5e-5, 9e-4],
            [1e-5, 3e-5, 2e-4, 3e-3],
            [1e-4, 5e-4, 3e-3, 4e-3],
            [2e-3, 6e-3, 2e-2, 2.1e-2],
        ],
    },
}
TABLE = TableCostModel.from_dict(TABLE_DATA)


def affine_samples(model: AffineCostModel) -> list[tuple[BatchWork, float]]:
    """Single-request grid plus decode batches, timed by ``model``."""
    samples = []
    for q in (1, 64, 512, 2048, 8192):
        for kv in (0, 1024, 16384, 131072):
            batch = BatchWork.single_group((q, kv))
            samples.append((batch, model.predict(batch)))
    for n in (8, 64, 256):
        batch = BatchWork.single_group(*[(1, 4096)] * n)
        samples.append((batch, model.predict(batch)))
    return samples


AFFINE_1 = AffineCostModel(base=2e-3, per_token=3e-5, per_attn=5e-10)
FITTED = TableCostModel.fit(affine_samples(AFFINE), layout=P(kvp=3))

MODELS = {
    "affine": AFFINE,
    "roofline-8b-h100": RooflineCostModel(model=LLAMA8B, hardware=H100, layout=P(kvp=2)),
    "roofline-8b-a100-3d": RooflineCostModel(
        model=LLAMA8B, hardware=get_hardware("a100"), layout=P(tp=4, spp=2, kvp=3)
    ),
    "roofline-70b-h200": RooflineCostModel(
        model=get_model_shape("llama3-70b"), hardware=get_hardware("h200"), layout=P(tp=8, kvp=2)
    ),
    "table": TABLE,
    "table-fitted": FITTED,
}
MODEL_IDS = sorted(MODELS)


def at_most(a: float, b: float, model: CostModel) -> bool:
    """``a <= b``; tables interpolate with rounding, so allow 1e-12 relative there."""
    slack = 1e-12 * abs(b) if isinstance(model, TableCostModel) else 0.0
    return a <= b + slack


def one(q: int, kv: int, tail: bool, kvp: int) -> BatchWork:
    groups = [()] * kvp
    groups[0] = (RequestWork(q, kv, tail),)
    return BatchWork(groups=tuple(groups))


items = st.tuples(st.integers(1, 20_000), st.integers(0, 2_000_000), st.booleans()).map(
    lambda t: RequestWork(*t)
)


@st.composite
def batches(draw: st.DrawFn, kvp: int) -> BatchWork:
    n = draw(st.integers(1, kvp))
    groups = draw(st.lists(st.lists(items, max_size=6), min_size=n, max_size=n))
    if not any(groups):
        groups[0].append(draw(items))
    return BatchWork(groups=tuple(tuple(g) for g in groups))


# ---------------------------------------------------------------------- every model
@pytest.mark.parametrize("name", MODEL_IDS)
@settings(max_examples=120, deadline=None)
@given(
    q=st.integers(1, 20_000),
    dq=st.integers(0, 5_000),
    kv=st.integers(0, 2_000_000),
    dkv=st.integers(0, 500_000),
    tail=st.booleans(),
)
def test_more_tokens_never_predicts_less(name, q, dq, kv, dkv, tail):
    model = MODELS[name]
    kvp = model.layout.kvp
    small = model.predict(one(q, kv, tail, kvp))
    assert small > 0
    assert at_most(small, model.predict(one(q + dq, kv, tail, kvp)), model)
    assert at_most(small, model.predict(one(q, kv + dkv, tail, kvp)), model)


@pytest.mark.parametrize("name", MODEL_IDS)
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_growing_a_batch_never_predicts_less(name, data):
    model = MODELS[name]
    batch = data.draw(batches(model.layout.kvp))
    groups = [list(g) for g in batch.groups]
    g = data.draw(st.integers(0, len(groups) - 1))
    if groups[g] and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(groups[g]) - 1))
        w = groups[g][i]
        q = w.q_tokens + data.draw(st.integers(0, 4096))
        groups[g][i] = RequestWork(q, w.kv_tokens + data.draw(st.integers(0, 10**5)), w.tail)
    else:
        groups[g].append(data.draw(items))
    bigger = BatchWork(groups=tuple(tuple(x) for x in groups))
    before = model.predict(batch)
    assert before > 0
    assert at_most(before, model.predict(bigger), model)


@pytest.mark.parametrize("name", MODEL_IDS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_predict_is_slowest_group_of_summed_features(name, data):
    model = MODELS[name]
    assert isinstance(model, AggregateCostModel) and isinstance(model, CostModel)
    batch = data.draw(batches(model.layout.kvp))
    expected = 0.0
    for group in batch.groups:
        if group:
            totals = [
                math.fsum(col)
                for col in zip(*(model_features(model, w) for w in group), strict=True)
            ]
            expected = max(expected, model.group_time(totals))
    assert model.predict(batch) == pytest.approx(expected, rel=1e-12)


def model_features(model: AggregateCostModel, w: RequestWork) -> tuple[float, ...]:
    f = model.features(w.q_tokens, w.kv_tokens, w.tail)
    assert len(f) == model.num_features
    return f


def test_cost_package_imports_only_stdlib_and_itself():
    allowed = set(sys.stdlib_module_names) | {"medha_sched"}
    for path in COST_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = {node.module.split(".")[0]}
            else:
                continue
            assert roots <= allowed, f"{path.name} imports {roots - allowed}"


# ---------------------------------------------------------------------- affine
def test_affine_exact_values():
    m = AffineCostModel(base=0.01, per_token=0.001, per_attn=1e-6, layout=P(kvp=2))
    tail_group = (RequestWork(10, 100), RequestWork(1, 50))
    expected_tail = 0.01 + 0.001 * 11 + 1e-6 * (10 * 110 + 1 * 51)
    assert m.predict(BatchWork(groups=(tail_group,))) == pytest.approx(expected_tail, rel=1e-15)
    other = (RequestWork(4, 200_000, tail=False),)
    expected_other = 0.01 + 1e-6 * 4 * 200_000
    assert m.features(4, 200_000, False) == (0, 800_000)
    assert m.predict(BatchWork(groups=(tail_group, other))) == pytest.approx(expected_other)
    assert m.predict(BatchWork(groups=((), ()))) == 0.0


# ---------------------------------------------------------------------- roofline
def weights_read_seconds(shape: ModelShape, hw: HardwareSpec) -> float:
    per_layer = shape.qkv_params + shape.out_params + shape.mlp_params
    weight_bytes = (shape.num_layers * per_layer + shape.head_params) * shape.bytes_per_param
    return weight_bytes / hw.hbm_bandwidth


def test_roofline_decode_is_bounded_by_the_weight_read():
    m = RooflineCostModel(model=LLAMA8B, hardware=H100)
    floor = weights_read_seconds(LLAMA8B, H100)  # ~15 GB / 3.35 TB/s ~ 4.5 ms
    assert 4.3e-3 < floor < 4.7e-3
    t = m.predict(BatchWork.single_group((1, 1000)))
    assert floor <= t <= 3 * floor
    assert 5e-3 <= t <= 30e-3


def test_roofline_prefill_is_near_the_flops_estimate():
    m = RooflineCostModel(model=LLAMA8B, hardware=H100)
    ideal = 2 * 8e9 * 4096 / 989e12
    t = m.predict(BatchWork.single_group((4096, 0)))
    assert ideal / 3 <= t <= ideal * 3


@pytest.mark.parametrize("kv", [0, 100_000])
def test_roofline_tp2_beats_tp1_on_a_big_chunk(kv):
    chunk = BatchWork.single_group((8192, kv))
    t1 = RooflineCostModel(model=LLAMA8B, hardware=H100, layout=P(tp=1)).predict(chunk)
    t2 = RooflineCostModel(model=LLAMA8B, hardware=H100, layout=P(tp=2)).predict(chunk)
    assert t2 < 0.75 * t1


@pytest.mark.parametrize("q,kv", [(1, 1000), (512, 50_000), (8192, 0)])
def test_roofline_spp_latency(q, kv):
    batch = BatchWork.single_group((q, kv))
    t1 = RooflineCostModel(model=LLAMA8B, hardware=H100, layout=P(spp=1)).predict(batch)
    t2 = RooflineCostModel(model=LLAMA8B, hardware=H100, layout=P(spp=2)).predict(batch)
    assert t2 > 0
    assert t2 >= 0.5 * t1
    assert t2 > t1  # the stage-to-stage activation send is not free


def test_roofline_kvp_merge_traffic_charges_non_tail_items():
    m = RooflineCostModel(model=LLAMA8B, hardware=H100, layout=P(kvp=2))
    f = m.features(64, 0, False)
    assert f[4] == 64 and f[0] == 0
    no_merge = list(f)
    no_merge[4] = 0
    assert m.group_time(f) > m.group_time(no_merge) > 0
    batch = BatchWork(groups=((RequestWork(64, 0, tail=False),), (RequestWork(64, 10),)))
    assert m.predict(batch) > 0


def test_roofline_presets_and_shape_sizes():
    assert LLAMA8B.num_params == pytest.approx(8.03e9, rel=0.01)
    assert get_model_shape("llama3-70b").num_params == pytest.approx(70.6e9, rel=0.01)
    assert get_hardware("a100").peak_flops == 312e12
    assert get_hardware("h200").hbm_bandwidth == 4.8e12
    assert get_hardware("h100").interconnect_bandwidth == 450e9


# ---------------------------------------------------------------------- table
def test_table_json_round_trip(tmp_path):
    path = tmp_path / "profile.json"
    TABLE.to_json(path)
    assert json.loads(path.read_text())["version"] == 1
    loaded = TableCostModel.from_json(path)
    assert loaded == TABLE
    FITTED.to_json(tmp_path / "fitted.json")
    fitted = TableCostModel.from_json(tmp_path / "fitted.json", layout=P(kvp=3))
    rng = random.Random(1)
    for _ in range(300):
        groups = tuple(
            tuple(
                RequestWork(rng.randint(1, 9000), rng.randint(0, 300_000), rng.random() < 0.7)
                for _ in range(rng.randint(1, 5))
            )
            for _ in range(2)
        )
        assert loaded.predict(BatchWork(groups=groups)) == TABLE.predict(BatchWork(groups=groups))
        assert fitted.predict(BatchWork(groups=groups)) == FITTED.predict(BatchWork(groups=groups))


def test_table_exact_at_grid_points_and_linear_between():
    att = TABLE_DATA["attention"]
    for i, q in enumerate(att["q_tokens"]):
        for j, kv in enumerate(att["kv_tokens"]):
            assert TABLE.attention_time(q, kv) == att["seconds"][i][j]
    lin = TABLE_DATA["linear"]
    for x, y in zip(lin["tokens"], lin["seconds"], strict=True):
        assert TABLE.linear_time(x) == y
    assert TABLE.linear_time(272) == pytest.approx((5.5e-3 + 1.2e-2) / 2)
    assert TABLE.attention_time(16, 500) == pytest.approx((1e-5 + 3e-5) / 2)
    corners = (1e-5 + 3e-5 + 1e-4 + 5e-4) / 4
    assert TABLE.attention_time(136, 500) == pytest.approx(corners)
    # tail item: attends to kv + q; the linear part counts its q once
    t = TABLE.predict(BatchWork.single_group((16, 984)))
    assert t == pytest.approx(1e-3 + TABLE.linear_time(16) + 3e-5)


def test_table_extrapolation_follows_the_last_segment():
    slope = (1.3e-1 - 1.2e-2) / (8192 - 512)
    assert TABLE.linear_time(16384) == pytest.approx(1.3e-1 + 8192 * slope)
    row_slope = (2.1e-2 - 2e-2) / 90_000
    assert TABLE.attention_time(4096, 200_000) >= 2.1e-2 + 100_000 * row_slope
    # rows 1 and 2 would cross beyond kv=100000 without the running maximum
    assert TABLE.attention_time(256, 10**7) >= TABLE.attention_time(16, 10**7)
    assert TABLE.attention_time(16, 10**7) == pytest.approx(3e-3 + (10**7 - 10**5) * 2.8e-3 / 9e4)


def test_table_prices_long_queries_as_tiles():
    # TABLE's last q_tokens is 4096: 10000 = 1808 + 2 * 4096
    tail = TABLE.attention_time(10_000, 30_000)
    pieces = [(1808, 21_808), (4096, 25_904), (4096, 30_000)]
    assert tail == pytest.approx(sum(TABLE.attention_time(q, x) for q, x in pieces))
    side = TABLE.attention_time(10_000, 30_000, causal=False)
    assert side == pytest.approx(
        TABLE.attention_time(1808, 30_000) + 2 * TABLE.attention_time(4096, 30_000)
    )
    # a whole prompt (no KV before it) is priced from kv = 0
    assert TABLE.attention_time(10_000, 10_000) == pytest.approx(
        sum(TABLE.attention_time(q, x) for q, x in [(1808, 1808), (4096, 5904), (4096, 10_000)])
    )
    batch = BatchWork(
        groups=((RequestWork(10_000, 20_000, False),), (RequestWork(10_000, 20_000),))
    )
    lin = TABLE.linear_time(10_000)
    assert TABLE.predict(batch) == pytest.approx(max(1e-3 + side, 1e-3 + lin + tail))


@settings(max_examples=200, deadline=None)
@given(
    q=st.floats(0.5, 50_000),
    dq=st.floats(0, 50_000),
    x=st.floats(0, 10**7),
    dx=st.floats(0, 10**7),
)
def test_table_extrapolation_is_monotone_and_non_negative(q, dq, x, dx):
    for m in (TABLE, FITTED):
        lo = m.attention_time(q, x)
        assert lo >= 0
        assert at_most(lo, m.attention_time(q + dq, x), m)
        assert at_most(lo, m.attention_time(q, x + dx), m)
        assert at_most(m.linear_time(q), m.linear_time(q + dq), m)


def test_table_fit_reproduces_an_affine_model():
    rng = random.Random(7)
    worst = 0.0
    for _ in range(500):
        groups = tuple(
            tuple(
                RequestWork(rng.randint(1, 8192), rng.randint(0, 400_000), rng.random() < 0.6)
                for _ in range(rng.randint(0, 8))
            )
            for _ in range(3)
        )
        batch = BatchWork(groups=groups)
        want = AFFINE.predict(batch)
        if want:
            worst = max(worst, abs(FITTED.predict(batch) / want - 1))
    assert worst < 0.01
    assert FITTED.base_s == pytest.approx(AFFINE.base, rel=1e-6)
    assert FITTED.layout == P(kvp=3)


def test_table_fit_with_explicit_base_and_repeated_samples():
    samples = affine_samples(AFFINE)
    fitted = TableCostModel.fit(samples + samples, base_s=0.002)
    assert fitted.base_s == 0.002
    batch = BatchWork.single_group((300, 5000))
    assert fitted.predict(batch) == pytest.approx(AFFINE.predict(batch), rel=1e-9)


def test_table_fit_separates_a_per_request_cost():
    """Timings with a fixed cost per request in the batch: the fit finds it, and
    neither decode batches nor prefills absorb it into ``linear``."""
    per_req = 8e-4

    def timed(*items: tuple[int, int]) -> tuple[BatchWork, float]:
        batch = BatchWork.single_group(*items)
        return batch, AFFINE_1.predict(batch) + per_req * len(items)

    samples = [timed((q, kv)) for q in (1, 16, 128, 1024) for kv in (0, 2048, 16384)]
    samples += [timed(*[(1, kv)] * n) for n in (2, 16, 64) for kv in (512, 4096)]
    fitted = TableCostModel.fit(samples)
    assert fitted.per_request_s == pytest.approx(per_req, rel=1e-6)
    assert fitted.base_s == pytest.approx(AFFINE_1.base, rel=1e-6)
    rng = random.Random(3)
    for _ in range(200):
        items = [(rng.choice([1, rng.randint(1, 1024)]), rng.randint(0, 30_000)) for _ in range(5)]
        items = items[: rng.randint(1, 5)]
        batch, want = timed(*items)
        assert fitted.predict(batch) == pytest.approx(want, rel=1e-6)
    # without a per-request term the same samples fit worse: decodes look far too costly
    plain = TableCostModel.fit(samples, per_request_s=0.0)
    batch, want = timed(*[(1, 1000)] * 32)
    assert fitted.predict(batch) == pytest.approx(want, rel=1e-6)
    assert abs(plain.predict(BatchWork.single_group((1024, 0))) / timed((1024, 0))[1] - 1) > 0.05


def test_table_fit_keeps_base_positive_on_noisy_first_points():
    # decode pairs 5 ms slower than the model: the first linear segment crosses 0
    samples = [
        (b, t + (5e-3 if len(b.groups[0]) == 2 else 0.0))
        for b, t in [
            (BatchWork.single_group(*items), AFFINE_1.predict(BatchWork.single_group(*items)))
            for items in [[(q, kv)] for q in (1, 64, 512) for kv in (0, 4096)]
            + [[(1, 1000)] * n for n in (2, 16)]
        ]
    ]
    fitted = TableCostModel.fit(samples, per_request_s=0.0)
    one = BatchWork.single_group((1, 0))
    assert fitted.base_s == pytest.approx(AFFINE_1.predict(one))
    assert fitted.predict(one) == pytest.approx(AFFINE_1.predict(one))
    assert fitted.linear_time(1) == 0.0


def test_table_fit_per_request_survives_a_negative_intercept():
    """A convex attention cost at the largest q puts that q's intercept below 0;
    the per-request cost is still found (it is bounded by the smallest q's)."""
    per_req = 8e-4

    def timed(*items: tuple[int, int]) -> tuple[BatchWork, float]:
        batch = BatchWork.single_group(*items)
        convex = sum(2e-8 * (kv + q) ** 2 for q, kv in items if q == 1024)
        return batch, AFFINE_1.predict(batch) + per_req * len(items) + convex

    samples = [timed((q, kv)) for q in (1, 16, 128, 1024) for kv in (0, 2048, 16384)]
    samples += [timed(*[(1, kv)] * n) for n in (2, 16, 64) for kv in (512, 4096)]
    fitted = TableCostModel.fit(samples)
    assert fitted.per_request_s == pytest.approx(per_req, rel=1e-6)
    assert fitted.base_s > 0


def test_table_per_request_field_round_trips_and_is_optional(tmp_path):
    data = table_with(per_request_s=2.5e-4)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    loaded = TableCostModel.from_json(path)
    assert loaded.per_request_s == 2.5e-4
    two = BatchWork.single_group((16, 984), (16, 984))
    assert loaded.predict(two) == pytest.approx(TABLE.predict(two) + 2 * 2.5e-4)
    assert TableCostModel.from_dict(loaded.to_dict()) == loaded
    assert TABLE.per_request_s == 0.0  # TABLE_DATA has no such field


# ---------------------------------------------------------------------- errors
def table_with(**changes) -> dict:
    data = json.loads(json.dumps(TABLE_DATA))
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = data
        for p in parents:
            node = node[p]
        if value is ...:
            del node[leaf]
        else:
            node[leaf] = value
    return data


BAD_TABLES = [
    (table_with(version=2), "'version'"),
    (table_with(version=True), "True"),
    (table_with(colour="red"), "'colour'"),
    (table_with(base_s=...), "'base_s'"),
    (table_with(base_s=0), "'base_s'"),
    (table_with(per_request_s=-1e-3), "'per_request_s' must be >= 0, got -0.001"),
    (table_with(per_request_s="x"), "'per_request_s'"),
    (table_with(linear__tokens=[1, 32, 32, 8192]), "'linear.tokens'"),
    (table_with(linear__tokens=[0, 32, 512, 8192]), "'linear.tokens'"),
    (table_with(linear__tokens=[1]), "'linear.tokens'"),
    (table_with(linear__seconds=[5e-3, 5.5e-3, 1.2e-2]), "'linear.seconds'"),
    (table_with(linear__seconds=[5e-3, 4e-3, 1.2e-2, 1.3e-1]), "'linear.seconds'"),
    (table_with(linear__seconds=[-1.0, 4e-3, 1.2e-2, 1.3e-1]), "-1.0"),
    (table_with(linear__seconds="fast"), "'fast'"),
    (table_with(linear__slope=1), "'linear.slope'"),
    (table_with(attention__kv_tokens=[-5, 1000, 10000, 100000]), "-5"),
    (table_with(attention__q_tokens=[1, 16, 256]), "'attention.seconds'"),
    (table_with(attention__seconds=[[0.0] * 4] * 3 + [[1.0, 1.0, 1.0]]), "attention.seconds[3]"),
    (table_with(attention__seconds=[[0.0] * 4, [1.0] * 4, [0.5] * 4, [2.0] * 4]), "in q"),
    (table_with(attention__seconds=...), "'attention.seconds'"),
    (table_with(layout={"tp": 0}), "tp must be an integer >= 1, got 0"),
    (table_with(layout={"dp": 2}), "'layout.dp'"),
    ([1, 2, 3], "top level"),
]


@pytest.mark.parametrize("data,needle", BAD_TABLES)
def test_bad_tables_name_the_field(tmp_path, data, needle):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as err:
        TableCostModel.from_json(path)
    assert needle in str(err.value)
    assert "bad.json" in str(err.value)


def test_table_file_errors(tmp_path):
    with pytest.raises(ValueError, match=r"missing.json"):
        TableCostModel.from_json(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"version": 1,')
    with pytest.raises(ValueError, match=r"broken.json.*not valid JSON"):
        TableCostModel.from_json(broken)
    nan = tmp_path / "nan.json"
    nan.write_text(json.dumps(table_with(base_s=float("nan"))))
    with pytest.raises(ValueError, match=r"nan.json.*'base_s'.*nan"):
        TableCostModel.from_json(nan)
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps(TABLE_DATA))
    with pytest.raises(ValueError, match=r"ok.json.*kvp=2.*kvp=1"):
        TableCostModel.from_json(ok, layout=P(kvp=1))


@pytest.mark.parametrize(
    "samples,needle",
    [
        ([(BatchWork.single_group((1, 0)), 1.0)], "q_tokens=[1]"),
        ([(BatchWork.single_group((1, 0), (2, 0)), 1.0)], "sample 0"),
        ([(BatchWork.single_group((1, 0)), -1.0)], "-1.0"),
        ([("batch", 1.0)], "'batch'"),
        ([(BatchWork(groups=((RequestWork(1, 0, tail=False),),)), 1.0)], "sample 0"),
        (
            [(BatchWork.single_group((q, kv)), 1.0) for q, kv in [(1, 0), (1, 9), (2, 0)]],
            "q_tokens=2, kv_tokens=9",
        ),
    ],
)
def test_bad_fit_samples(samples, needle):
    with pytest.raises(ValueError) as err:
        TableCostModel.fit(samples)
    assert needle in str(err.value)


NAN = float("nan")
BAD_VALUES = [
    (lambda: AffineCostModel(base=1e-3, per_token=-1.0, per_attn=0.0), "per_token", "-1.0"),
    (lambda: AffineCostModel(base=1e-3, per_token=0.0, per_attn=NAN), "per_attn", "nan"),
    (lambda: AffineCostModel(base=0.0, per_token=1.0, per_attn=1.0), "base", "0.0"),
    (lambda: AffineCostModel(base=1, per_token=1, per_attn=1, layout="tp2"), "layout", "tp2"),
    (
        lambda: HardwareSpec(peak_flops=0, hbm_bandwidth=1, interconnect_bandwidth=1),
        "peak_flops",
        "0",
    ),
    (
        lambda: HardwareSpec(
            peak_flops=1, hbm_bandwidth=1, interconnect_bandwidth=1, memory_efficiency=1.5
        ),
        "memory_efficiency",
        "1.5",
    ),
    (lambda: get_hardware("b200"), "'b200'", "a100, h100, h200"),
    (lambda: get_model_shape("gpt-5"), "'gpt-5'", "llama3-70b, llama3-8b"),
    (
        lambda: ModelShape(
            num_layers=1,
            hidden_size=8,
            num_q_heads=4,
            num_kv_heads=3,
            head_dim=2,
            intermediate_size=8,
            vocab_size=8,
        ),
        "num_kv_heads=3",
        "num_q_heads=4",
    ),
    (
        lambda: ModelShape(
            num_layers=0,
            hidden_size=8,
            num_q_heads=4,
            num_kv_heads=2,
            head_dim=2,
            intermediate_size=8,
            vocab_size=8,
        ),
        "num_layers",
        "0",
    ),
    (lambda: RooflineCostModel(model="llama3-8b", hardware=H100), "model", "'llama3-8b'"),
    (lambda: RooflineCostModel(model=LLAMA8B, hardware="h100"), "hardware", "'h100'"),
    (lambda: TableCostModel.from_dict(table_with(base_s=-2)), "'base_s'", "-2"),
]


@pytest.mark.parametrize("make,name,value", BAD_VALUES)
def test_nonsense_values_raise_value_error_naming_them(make, name, value):
    with pytest.raises(ValueError) as err:
        make()
    assert name in str(err.value) and value in str(err.value)


# ---------------------------------------------------------------------- specs
def test_affine_spec():
    m = parse_cost_model_spec("affine:base=0.004, per_token=4e-5,per_attn=7e-10", layout=P(kvp=2))
    assert m == AffineCostModel(base=0.004, per_token=4e-5, per_attn=7e-10, layout=P(kvp=2))


def test_roofline_spec_takes_parallelism_from_the_layout():
    m = parse_cost_model_spec("roofline:model=llama3-70b,gpu=a100", layout=P(tp=8, spp=2))
    assert isinstance(m, RooflineCostModel)
    assert m.model.name == "llama3-70b" and m.hardware.name == "a100"
    assert m.layout == P(tp=8, spp=2)
    direct = RooflineCostModel(
        model=get_model_shape("llama3-70b"), hardware=get_hardware("a100"), layout=P(tp=8, spp=2)
    )
    batch = BatchWork.single_group((2048, 10_000))
    assert m.predict(batch) == direct.predict(batch)


def test_table_spec_bare_and_keyed_path(tmp_path):
    path = tmp_path / "prof=v1.json"
    TABLE.to_json(path)
    layout = P(kvp=2)
    assert parse_cost_model_spec(f"table:{path}", layout=layout) == TABLE
    assert parse_cost_model_spec(f"table:path={path}", layout=layout) == TABLE
    with pytest.raises(ValueError, match=r"kvp=2.*kvp=1"):
        parse_cost_model_spec(f"table:{path}")


@pytest.mark.parametrize(
    "spec,needles",
    [
        (
            "foo:x=1",
            ["unknown cost model 'foo' in spec 'foo:x=1'; known: ", "affine, online, roofline"],
        ),
        ("", ["''"]),
        (":base=1", ["':base=1'"]),
        ("affine:base=1,per_token=1", ["'per_attn'", "affine:base=1,per_token=1"]),
        ("affine:base=x,per_token=1,per_attn=1", ["base='x'"]),
        ("affine:base=1,per_token=1,per_attn=1,bogus=2", ["'bogus'"]),
        ("affine:base=1,,per_token=1", ["malformed item ''"]),
        ("affine:base=1,base=2", ["duplicate key 'base'"]),
        ("affine:base=nan,per_token=1,per_attn=1", ["base", "nan"]),
        ("roofline:model=llama3-8b,gpu=b200", ["'b200'", "h100"]),
        ("roofline:model=llama9,gpu=h100", ["'llama9'"]),
        ("table:/no/such/profile.json", ["/no/such/profile.json"]),
        ("table", ["'path'"]),
    ],
)
def test_bad_specs_name_the_problem(spec, needles):
    with pytest.raises(ValueError) as err:
        parse_cost_model_spec(spec)
    for needle in needles:
        assert needle in str(err.value)


# ---------------------------------------------------------------------- registry
@pytest.fixture
def fresh_registry(monkeypatch):
    monkeypatch.setattr(registry_module, "_registry", dict(registry_module._registry))


class ScaledAffine(AffineCostModel):
    """A custom model: an affine model with one knob."""

    @classmethod
    def from_spec(cls, params, *, layout):
        scale = float(params.get("scale", "1"))
        return cls(base=1e-3 * scale, per_token=1e-5, per_attn=0.0, layout=layout)


@pytest.mark.usefixtures("fresh_registry")
def test_register_a_custom_model():
    assert "scaled" not in available_cost_models()
    register_cost_model("scaled", ScaledAffine)
    assert "scaled" in available_cost_models()
    m = parse_cost_model_spec("scaled:scale=2", layout=P(kvp=2))
    assert isinstance(m, ScaledAffine) and m.base == 2e-3 and m.layout == P(kvp=2)
    assert create_cost_model("scaled", {}).base == 1e-3
    with pytest.raises(ValueError, match=r"'scaled' is already registered"):
        register_cost_model("scaled", ScaledAffine)
    with pytest.raises(ValueError, match=r"'affine' is already registered"):
        register_cost_model("affine", ScaledAffine)
    register_cost_model("scaled", lambda params, *, layout: AFFINE, replace=True)
    assert create_cost_model("scaled", {}) is AFFINE


@pytest.mark.usefixtures("fresh_registry")
def test_registry_rejects_bad_registrations():
    with pytest.raises(ValueError, match=r"'bad:name'"):
        register_cost_model("bad:name", ScaledAffine)
    with pytest.raises(ValueError, match=r"'x'.*42"):
        register_cost_model("x", 42)
    register_cost_model("broken", lambda params, *, layout: "not a model")
    with pytest.raises(ValueError, match=r"'broken'.*'not a model'"):
        create_cost_model("broken", {})
    with pytest.raises(ValueError, match=r"str to str"):
        create_cost_model("affine", {"base": 1.0})


PLUGIN_SOURCE = """
from medha_sched.cost import AffineCostModel

class PluginModel(AffineCostModel):
    @classmethod
    def from_spec(cls, params, *, layout):
        return cls(base=float(params["base"]), per_token=0.0, per_attn=0.0, layout=layout)
"""


@pytest.mark.usefixtures("fresh_registry")
def test_entry_point_plugins_are_found_and_loaded(tmp_path, monkeypatch):
    module = "medha_cost_plugin_for_tests"
    (tmp_path / f"{module}.py").write_text(PLUGIN_SOURCE)
    info = tmp_path / "medha_cost_plugin_for_tests-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: medha-cost-plugin-for-tests\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(
        f"[medha.cost_models]\nplugged = {module}:PluginModel\n"
        "unloadable = medha_no_such_module_anywhere:Model\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    try:
        assert {"plugged", "unloadable"} <= set(available_cost_models())
        assert module not in sys.modules  # listed, not loaded
        m = parse_cost_model_spec("plugged:base=0.5")
        assert type(m).__name__ == "PluginModel" and m.base == 0.5
        assert m.predict(BatchWork.single_group((1, 0))) == 0.5
        with pytest.raises(ValueError, match=r"cannot load cost model 'unloadable'"):
            parse_cost_model_spec("unloadable:x=1")
    finally:
        sys.modules.pop(module, None)


def test_a_probe_before_seed_is_not_reused_after_it() -> None:
    """``BatchCost.seed`` changes the batch: probes made before it are dropped."""
    from medha_sched.batch_cost import BatchCost

    from .models import PolyCostModel

    model = PolyCostModel(base=1e-3, a=1e-4, b=1e-8, c=1e-7, d=1e-9, e=1e-6)
    work = (0, 100, 0, True)
    totals = list(model.features(5, 2000, True))
    probed, fresh = BatchCost(model, 1), BatchCost(model, 1)
    probed.time_with([work])  # against the empty batch
    probed.seed([totals])
    probed.add([work])
    fresh.seed([list(totals)])
    fresh.add([work])
    assert probed.time == fresh.time
