"""GGUF files without the network: dequantization, the Q/K permutation, TP slices, bad files.

Files are written with the ``gguf`` package from checkpoints transformers
wrote (:mod:`tests.runtime.gguf_files`), so the weights are known exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from medha_runtime.engine import load_model_info  # noqa: E402
from medha_runtime.model import (  # noqa: E402
    ConfigError,
    CorruptFileError,
    ModelLoadError,
    UnsupportedModelError,
    load_config,
    load_model,
)
from medha_runtime.model.dequant import dequantize_rows  # noqa: E402
from medha_runtime.model.gguf import GGUFSource, open_gguf, unpermute_rows  # noqa: E402
from tests.runtime.gguf_files import permute_rows, write_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType
CKPT = "mha-default-legacy"  # untied, plain RoPE: what a llama GGUF expresses without extras


def _state(directory: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    config = json.loads((directory / "config.json").read_text())
    return load_file(directory / "model.safetensors"), config


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_dequantize_is_bit_identical_to_gguf_reference(qtype: str) -> None:
    """Our torch decoders (and the reference path) give gguf.quants.dequantize's exact floats."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 128)) * rng.uniform(0.01, 5, (6, 1))).astype(np.float32)
    kind = Q[qtype]
    raw = x.astype(np.float16).view(np.uint8) if kind == Q.F16 else gguf.quants.quantize(x, kind)
    ref = gguf.quants.dequantize(raw, kind).astype(np.float32)
    got = dequantize_rows(raw.view(np.uint8).reshape(6, -1), int(kind), 128)
    assert torch.equal(got, torch.from_numpy(ref))
    assert (got - torch.from_numpy(x)).abs().max() < np.abs(x).max() / 4  # it decodes x at all


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    w = torch.arange(6 * 8 * 3, dtype=torch.float32).reshape(6 * 8, 3)
    stored = torch.from_numpy(permute_rows(w.numpy(), 6))
    assert not torch.equal(stored, w)
    assert torch.equal(unpermute_rows(stored, 8), w)
    # a TP rank's slice of whole heads unpermutes on its own
    assert torch.equal(unpermute_rows(stored[16:32], 8), w[16:32])


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_weights_equal_the_checkpoint(checkpoint, tmp_path, qtype: str) -> None:
    """Every parameter loaded from the GGUF equals the safetensors one (F32), or its
    quantized value as gguf's reference decodes it (Q8_0)."""
    directory = checkpoint(CKPT)
    state, config = _state(directory)
    file = write_gguf(tmp_path / "m.gguf", state, config, qtype=qtype)
    ours, cfg = load_model(file, dtype="float32")
    if qtype == "F32":
        ref_state = state
    else:
        ref_state = {}
        for name, t in state.items():
            if t.ndim == 2:
                raw = gguf.quants.quantize(t.numpy(), Q.Q8_0)
                t = torch.from_numpy(gguf.quants.dequantize(raw, Q.Q8_0))
            ref_state[name] = t
        ref_dir = tmp_path / "ref"
        ref_dir.mkdir()
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in ref_state.items()}, ref_dir / "model.safetensors")
        (ref_dir / "config.json").write_text(json.dumps(config))
        directory = ref_dir
    theirs, ref_cfg = load_model(directory, dtype="float32")
    eps = float(np.float32(ref_cfg.rms_norm_eps))  # GGUF stores it as float32
    assert cfg == ref_cfg.replace(rms_norm_eps=eps, bos_token_id=None, eos_token_ids=())
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_tp_slices_equal_the_whole(checkpoint, tmp_path) -> None:
    """Rows and block-aligned columns read for a rank equal the slice of the whole tensor."""
    state, config = _state(checkpoint(CKPT))
    file = write_gguf(tmp_path / "m.gguf", state, config, qtype="Q4_1")
    ckpt = open_gguf(file)
    src = GGUFSource(ckpt, ckpt.config())
    q = "model.layers.1.self_attn.q_proj.weight"
    whole = src.read(q, None, 0, 0)
    assert torch.equal(src.read(q, 0, 16, 48), whole[16:48])  # heads 1-2 of 4 (head_dim 16)
    down = "model.layers.0.mlp.down_proj.weight"  # [64, 96]: columns 32..64 are whole blocks
    assert torch.equal(src.read(down, 1, 32, 64), src.read(down, None, 0, 0)[:, 32:64])
    assert torch.equal(src.read(down, 1, 40, 72), src.read(down, None, 0, 0)[:, 40:72])


def _good_file(checkpoint, tmp_path: Path, **kw) -> Path:
    state, config = _state(checkpoint(CKPT))
    return write_gguf(tmp_path / "good.gguf", state, config, **kw)


def _assert_one_clear_error(exc: pytest.ExceptionInfo, path: Path, *words: str) -> None:
    text = str(exc.value)
    assert str(path) in text and "\n" not in text, text
    for w in words:
        assert w in text, text


def test_wrong_magic(tmp_path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(CorruptFileError) as exc:
        load_model(bad)
    _assert_one_clear_error(exc, bad, "not a GGUF file", "GGML")


@pytest.mark.parametrize("keep", [0.5, 0.99, 0.001])
def test_truncated(checkpoint, tmp_path, keep: float) -> None:
    good = _good_file(checkpoint, tmp_path)
    data = good.read_bytes()
    bad = tmp_path / f"cut{keep}.gguf"
    bad.write_bytes(data[: max(8, int(len(data) * keep))])
    with pytest.raises(CorruptFileError) as exc:
        load_model(bad)
    _assert_one_clear_error(exc, bad, "truncated")
    assert "dtype" not in str(exc.value) and "Error" not in str(exc.value)  # no NumPy wording


def test_unsupported_tensor_type(checkpoint, tmp_path) -> None:
    """An IQ4_NL tensor: refused by name and type before any weight is built."""
    size = gguf.GGML_QUANT_SIZES[Q.IQ4_NL][1]
    raw = np.zeros((64, 2 * size), dtype=np.uint8)  # 64 rows of 64 values
    bad = _good_file(
        checkpoint, tmp_path, extra_tensors={"blk.0.attn_extra.weight": (raw, Q.IQ4_NL)}
    )
    with pytest.raises(UnsupportedModelError) as exc:
        load_config(bad)
    _assert_one_clear_error(exc, bad, "blk.0.attn_extra.weight", "IQ4_NL", "not supported")


def test_missing_tokenizer_metadata(checkpoint, tmp_path) -> None:
    good = _good_file(checkpoint, tmp_path)
    load_model(good)  # the weights are fine
    with pytest.raises(ConfigError) as exc:
        load_model_info(str(good))
    _assert_one_clear_error(exc, good, "no tokenizer")


def test_serve_bad_file_is_one_line(tmp_path) -> None:
    """The CLI prints one error line naming the file and exits 1: no traceback, no server."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"\x00" * 64)
    proc = subprocess.run(
        [sys.executable, "-m", "medha_runtime", "serve", str(bad), "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and "not a GGUF file" in lines[0], lines


def test_serve_truncated_file_ends_in_one_line_naming_it(checkpoint, tmp_path) -> None:
    """Past the magic the engine finds the damage: the last line says so in the model's
    words (no exception class, no NumPy), no traceback, exit 1."""
    from medha_runtime.server.launch import free_port

    data = _good_file(checkpoint, tmp_path).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:200])
    cmd = [sys.executable, "-m", "medha_runtime", "serve", str(cut), "--port", str(free_port())]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"medha-runtime serve: error: the engine failed to start: {cut}: "), last
    assert "truncated" in last and "Error" not in last, last
    assert "Traceback" not in proc.stderr


def test_errors_are_model_load_errors(tmp_path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError):
        load_model(bad)


PROMPT = [1, 17, 42, 5, 88, 23, 61, 9, 70, 33, 14, 50, 3]


def _tp_worker(rank: int, world_size: int, init: str, path: str) -> dict:
    from medha_parallel import ParallelLayout, ParallelState, TPCommunicator
    from tests.runtime.checkpoints import greedy

    state = ParallelState.initialize(
        ParallelLayout(tp=world_size),
        backend="gloo",
        init_method=init,
        rank=rank,
        world_size=world_size,
    )
    model, _ = load_model(path, dtype="float32", tp=TPCommunicator(state))
    return {
        "greedy": greedy(model, PROMPT, 8, chunk=5),
        "qkv_rows": model.layers["0"].self_attn.qkv_proj.weight.shape[0],
        "embed_rows": model.embed_tokens.weight.shape[0],
    }


def test_tp2_quantized_gguf_matches_one_process(checkpoint, tmp_path) -> None:
    """Each of two gloo ranks dequantizes only its rows of a Q4_1 file: the same greedy tokens."""
    from tests.parallel.dist import launch
    from tests.runtime.checkpoints import greedy

    file = _good_file(checkpoint, tmp_path, qtype="Q4_1")
    single, _ = load_model(file, dtype="float32")
    want = greedy(single, PROMPT, 8, chunk=5)
    for res in launch(_tp_worker, 2, str(file), timeout=120):
        assert res["greedy"] == want
        assert res["qkv_rows"] * 2 == single.layers["0"].self_attn.qkv_proj.weight.shape[0]
        assert res["embed_rows"] * 2 == single.embed_tokens.weight.shape[0] + 1  # 97 → 2 x 49


def test_llama3_rope_freqs_load_as_llama3_rope(checkpoint, tmp_path) -> None:
    """A Llama 3.1-style file (``rope_freqs`` divisors) gives transformers' llama3 frequencies
    and the checkpoint's greedy tokens."""
    from medha_runtime.model.rope import inv_freq
    from tests.runtime.checkpoints import greedy
    from tests.runtime.gguf_files import llama3_rope_freqs

    directory = checkpoint("gqa-llama3-legacy")  # head_dim 16, factor 8, low 1, high 4, orig 32
    state, config = _state(directory)
    rope = {"rope_theta": config["rope_theta"], **config["rope_scaling"]}
    freqs = llama3_rope_freqs(rope, config["head_dim"])
    file = write_gguf(tmp_path / "l3.gguf", state, config, rope_freqs=freqs)
    ours, cfg = load_model(file, dtype="float32")
    theirs, ref = load_model(directory, dtype="float32")
    assert cfg.rope.rope_type == "llama3"
    kw = {"head_dim": 16, "max_position_embeddings": ref.max_position_embeddings}
    assert torch.allclose(inv_freq(cfg.rope, **kw)[0], inv_freq(ref.rope, **kw)[0], rtol=1e-6)
    assert greedy(ours, PROMPT, 8, chunk=5) == greedy(theirs, PROMPT, 8, chunk=5)


L31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
       "original_max_position_embeddings": 8192}  # fmt: skip


@pytest.mark.parametrize(
    ("theta", "head_dim", "rope", "ok"),
    [
        (500000.0, 128, L31, True),  # Llama 3.1/3.2 files: many smoothed frequencies to fit
        (10000.0, 16, {**L31, "high_freq_factor": 16.0,
                       "original_max_position_embeddings": 1024}, True),  # two
        (10000.0, 16, {**L31, "factor": 32.0}, True),  # one smoothed frequency
        (10000.0, 16, None, False),  # arbitrary divisors: refused
    ],
)  # fmt: skip
def test_rope_freqs_fit(tmp_path, theta: float, head_dim: int, rope, ok: bool) -> None:
    from medha_runtime.model.config import RopeConfig
    from medha_runtime.model.rope import inv_freq
    from tests.runtime.gguf_files import llama3_rope_freqs

    config = {
        "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 1,
        "max_position_embeddings": 4096, "hidden_size": 32, "intermediate_size": 64,
        "rms_norm_eps": 1e-5, "rope_theta": theta, "vocab_size": 16, "head_dim": head_dim,
    }  # fmt: skip
    if rope is None:
        freqs = np.array([1.0, 1.5, 1.2, 3.0, 2.0, 8.0, 8.0, 8.0], dtype=np.float32)
    else:
        freqs = llama3_rope_freqs({"rope_theta": theta, **rope}, head_dim)
    file = write_gguf(tmp_path / "r.gguf", {}, config, rope_freqs=freqs)
    if not ok:
        with pytest.raises(UnsupportedModelError) as exc:
            load_config(file)
        _assert_one_clear_error(exc, file, "rope_freqs.weight")
        return
    got = load_config(file).rope
    want = RopeConfig(rope_type="llama3", theta=theta, **{
        "factor": rope["factor"], "low_freq_factor": 1.0,
        "high_freq_factor": rope["high_freq_factor"],
        "original_max_position_embeddings": rope["original_max_position_embeddings"],
    })  # fmt: skip
    kw = {"head_dim": head_dim, "max_position_embeddings": 4096}
    assert torch.allclose(inv_freq(got, **kw)[0], inv_freq(want, **kw)[0], rtol=1e-5)
