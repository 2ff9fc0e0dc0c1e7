"""``random:CONFIG`` models: any shape from a config alone, weights drawn on the device."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from medha_runtime import LLM, SamplingParams
from medha_runtime.model import MissingFileError, load_config, load_model
from medha_runtime.model.random_weights import checkpoint_shapes, random_config_path
from medha_runtime.model.tiny import save_tiny, tiny_config, tiny_state_dict
from medha_sched import AffineCostModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")
COST = AffineCostModel(base=1e-3, per_token=1e-5, per_attn=1e-9)
ROOT = Path(__file__).resolve().parents[2]


def _config(path: Path, **changes) -> Path:
    d = tiny_config().to_hf_dict() | {"vocab_size": 300, "tie_word_embeddings": False} | changes
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(d))
    return path


def test_checkpoint_shapes_match_a_real_checkpoint() -> None:
    real = {k: tuple(v.shape) for k, v in tiny_state_dict().items()}
    assert checkpoint_shapes(tiny_config()) == real


def test_weights_are_drawn_for_every_parameter(tmp_path: Path) -> None:
    d = _config(tmp_path / "m", attention_bias=True, hidden_size=128, intermediate_size=256)
    model, config = load_model(f"random:{d}", dtype="float32")
    assert config.vocab_size == 300 and config.hidden_size == 128
    params = dict(model.named_parameters())
    assert params, "the model has no parameters"
    for name, p in params.items():
        assert p.device.type == "cpu" and p.dtype == torch.float32, name
        assert torch.isfinite(p).all(), name
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith(".bias"):
            assert not p.any(), name
        else:  # N(0, 1/fan_in): the sample std of >= 16K draws is within 5% of it
            want = 1.0 if "embed" in name or "lm_head" in name else p.shape[1] ** -0.5
            assert math.isclose(p.std().item(), want, rel_tol=0.05), (name, p.std().item())
    up = params["layers.0.mlp.gate_up_proj.weight"]
    half = up.shape[0] // 2
    assert not torch.equal(up[:half], up[half:])  # gate and up are different draws


def test_the_same_seed_gives_the_same_weights(tmp_path: Path) -> None:
    d = _config(tmp_path / "m")
    a, _ = load_model(f"random:{d / 'config.json'}", dtype="bfloat16")
    b, _ = load_model(f"random:{d}", dtype="bfloat16")
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert pa.dtype == torch.bfloat16 and torch.equal(pa, pb), name


@pytest.mark.parametrize(
    ("spec", "needle"),
    [("random:", "name a config.json"), ("random:{tmp}/none", "none is not a file")],
)
def test_bad_specs_are_named(tmp_path: Path, spec: str, needle: str) -> None:
    spec = spec.format(tmp=tmp_path)
    with pytest.raises(MissingFileError, match=re.escape(needle)):
        load_config(spec)
    (tmp_path / "empty").mkdir()
    with pytest.raises(MissingFileError, match=r"config\.json is not a file"):
        random_config_path(f"random:{tmp_path / 'empty'}")
    assert random_config_path("tiny") is None and random_config_path(str(tmp_path)) is None


def test_llm_runs_a_random_model_from_token_ids(tmp_path: Path) -> None:
    d = _config(tmp_path / "m")
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    with LLM(f"random:{d}", cost_model=COST) as llm:
        outs = llm.generate([[5, 6, 7, 8], list(range(3, 40))], params)
        with pytest.raises(ValueError, match="no tokenizer"):
            llm.generate(["text needs a tokenizer"], params)
    for out in outs:
        ids = out.outputs[0].token_ids
        assert len(ids) == 5 and all(0 <= t < 300 for t in ids)


def test_a_tokenizer_beside_the_config_is_used(tmp_path: Path) -> None:
    d = save_tiny(tmp_path / "tiny")
    (d / "model.safetensors").unlink()  # the weights are not read
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with LLM(f"random:{d}", cost_model=COST) as llm:
        (out,) = llm.generate(["hello"], params)
    assert out.prompt_token_ids[1:] == list(b"hello") and len(out.outputs[0].token_ids) == 3


def test_profile_cli_takes_a_random_model(tmp_path: Path) -> None:
    d = _config(tmp_path / "m")
    out = tmp_path / "profile.json"
    cmd = [sys.executable, "-m", "medha_runtime", "profile", f"random:{d}", "--out", str(out)]
    cmd += ["--prefill-q", "1,16", "--prefill-kv", "0,64", "--decode-n", "2", "--decode-kv", "32"]
    proc = subprocess.run(
        [*cmd, "--repeats", "1", "--device", "cpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    meta = json.loads(out.read_text())["meta"]
    assert meta["model"] == f"random:{d}" and len(meta["measurements"]) == 5
