"""Loading Hugging Face directories: config forms, shards, TP slices, and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from medha_runtime.model import (
    ConfigError,
    CorruptFileError,
    LlamaModel,
    MissingFileError,
    MissingTensorError,
    ModelConfig,
    ShapeMismatchError,
    UnsupportedModelError,
    load_config,
    load_model,
)
from medha_runtime.model.loader import DictSource, load_weights, weight_plan

LAYER1_UP = "model.layers.1.mlp.up_proj.weight"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes) -> None:
    file = path / "config.json"
    data = json.loads(file.read_text())
    data.update(changes)
    file.write_text(json.dumps(data))


def test_both_config_forms_parse_to_the_same_rope(checkpoint) -> None:
    current = load_config(checkpoint("gqa-llama3-tied-sharded"))
    legacy_raw = json.loads((checkpoint("gqa-llama3-legacy") / "config.json").read_text())
    assert "rope_parameters" not in legacy_raw and legacy_raw["rope_scaling"]["rope_type"]
    legacy = load_config(checkpoint("gqa-llama3-legacy"))
    assert current.rope == legacy.rope
    assert current.rope.rope_type == "llama3" and current.rope.theta == 500000.0
    assert current.tie_word_embeddings and not legacy.tie_word_embeddings
    assert (current.num_q_heads, current.num_kv_heads, current.head_dim) == (4, 2, 16)
    assert (legacy.num_q_heads, legacy.num_kv_heads, legacy.head_dim) == (8, 2, 16)
    assert current.eos_token_ids == (2,) and current.bos_token_id == 1
    old = load_config(checkpoint("gqa-linear-legacy-type"))
    assert (old.rope.rope_type, old.rope.factor) == ("linear", 2.0)
    assert load_config(checkpoint("mha-default-legacy")).rope.rope_type == "default"


def test_config_fields_and_eos_list() -> None:
    d = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "torch_dtype": "bfloat16",
    }
    c = ModelConfig.from_hf_dict(d, source="llama-3.2-1b/config.json")
    assert c.head_dim == 64 and c.dtype == "bfloat16" and c.torch_dtype == torch.bfloat16
    assert c.eos_token_ids == (128001, 128008, 128009)
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c


#: a valid llama3 RoPE block (Llama 3.1's numbers)
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 5e5,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
}


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, UnsupportedModelError, ["GPT2LMHeadModel"]),
        ({"hidden_act": "gelu"}, UnsupportedModelError, ["hidden_act", "gelu"]),
        (
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
            UnsupportedModelError,
            ["rope_parameters.rope_type", "longrope"],
        ),
        (
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}},
            ConfigError,
            ["rope_parameters.factor"],
        ),
        ({"hidden_size": None}, ConfigError, ["hidden_size"]),
        ({"num_key_value_heads": 3}, ConfigError, ["num_q_heads=4", "num_kv_heads=3"]),
        ({"quantization_config": {"quant_method": "gptq"}}, UnsupportedModelError, ["gptq"]),
        ({"dtype": "float8_e4m3fn"}, UnsupportedModelError, ["float8_e4m3fn"]),
        ({"eos_token_id": [2, None]}, ConfigError, ["eos_token_id"]),
        ({"eos_token_id": {"id": 2}}, ConfigError, ["eos_token_id"]),
        ({"rms_norm_eps": "tiny"}, ConfigError, ["rms_norm_eps", "tiny"]),
        ({"rms_norm_eps": [1e-5]}, ConfigError, ["rms_norm_eps"]),
        ({"architectures": 5}, ConfigError, ["architectures", "5"]),
        ({"quantization_config": "gptq"}, UnsupportedModelError, ["gptq"]),
        ({"tie_word_embeddings": "false"}, ConfigError, ["tie_word_embeddings", "'false'"]),
        ({"attention_bias": "no"}, ConfigError, ["attention_bias", "'no'"]),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": None}},
            ConfigError,
            ["rope_parameters.rope_theta", "None"],
        ),
        (
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": [2]}},
            ConfigError,
            ["rope_parameters.factor", "[2]"],
        ),
        (
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 1e999}},
            ConfigError,
            ["rope_parameters.factor", "inf"],
        ),
        ({"rms_norm_eps": 1e999}, ConfigError, ["rms_norm_eps", "inf"]),
        *(
            (
                {"rope_parameters": {**_LLAMA3_ROPE, "original_max_position_embeddings": bad}},
                ConfigError,
                ["rope_parameters.original_max_position_embeddings", repr(bad)],
            )
            for bad in (1e999, -5, 2048.5)  # OverflowError; accepted; cut to 2048
        ),
    ],
)
def test_bad_configs_name_the_file_and_field(checkpoint, tmp_path, change, error, words) -> None:
    path = _copy(checkpoint("gqa-llama3-tied-sharded"), tmp_path / "m")
    _edit_config(path, **change)
    with pytest.raises(error) as info:
        load_model(path)
    message = str(info.value)
    assert str(path / "config.json") in message
    for word in words:
        assert word in message


def test_missing_directory_and_config(tmp_path) -> None:
    with pytest.raises(MissingFileError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(MissingFileError, match=r"config\.json"):
        load_model(tmp_path)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_json_file_not_utf8_names_the_file(checkpoint, tmp_path, name: str) -> None:
    path = _copy(checkpoint("gqa-llama3-tied-sharded"), tmp_path / "m")
    (path / name).write_bytes(b'{"weight_map": "\xff"}')
    with pytest.raises(ConfigError) as info:
        load_model(path)
    assert str(path / name) in str(info.value), info.value


def test_missing_weights(checkpoint, tmp_path) -> None:
    path = tmp_path / "m"
    path.mkdir()
    shutil.copy(checkpoint("mha-default-legacy") / "config.json", path)
    with pytest.raises(MissingFileError, match=r"model\.safetensors"):
        load_model(path)
    (path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(MissingFileError, match=r"pytorch_model\.bin.*safetensors"):
        load_model(path)


def test_missing_tensor_is_named(checkpoint, tmp_path) -> None:
    path = _copy(checkpoint("mha-default-legacy"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors[LAYER1_UP]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(MissingTensorError) as info:
        load_model(path)
    assert LAYER1_UP in str(info.value) and "model.safetensors" in str(info.value)
    # A stage that does not hold layer 1 never reads it.
    model, _ = load_model(path, layer_range=range(2, 3))
    assert list(model.layers) == ["2"]


def test_untied_checkpoint_without_lm_head_is_an_error(checkpoint, tmp_path) -> None:
    path = _copy(checkpoint("mha-default-legacy"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(MissingTensorError, match=r"lm_head\.weight"):
        load_model(path)


def test_wrong_shape_names_tensor_expected_and_got(checkpoint, tmp_path) -> None:
    path = _copy(checkpoint("mha-default-legacy"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    tensors[LAYER1_UP] = torch.zeros(95, 64)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ShapeMismatchError) as info:
        load_model(path)
    message = str(info.value)
    assert LAYER1_UP in message and "[95, 64]" in message and "[96, 64]" in message


def test_integer_weights_are_refused_not_cast(checkpoint, tmp_path) -> None:
    path = _copy(checkpoint("mha-default-legacy"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    tensors[LAYER1_UP] = tensors[LAYER1_UP].to(torch.int8)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(UnsupportedModelError) as info:
        load_model(path)
    message = str(info.value)
    assert LAYER1_UP in message and "torch.int8" in message and "model.safetensors" in message


def test_sharded_index_pointing_to_a_missing_file(checkpoint, tmp_path) -> None:
    path = _copy(checkpoint("gqa-llama3-tied-sharded"), tmp_path / "m")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.norm.weight"]
    (path / shard).unlink()
    with pytest.raises(MissingFileError) as info:
        load_model(path)
    assert shard in str(info.value) and "model.safetensors.index.json" in str(info.value)


@pytest.mark.parametrize("keep", [0.5, 0.0001, 0.0])
def test_truncated_single_file_is_named(checkpoint, tmp_path, keep: float) -> None:
    path = _copy(checkpoint("mha-default-legacy"), tmp_path / "m")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CorruptFileError) as info:
        load_model(path)
    message = str(info.value)
    assert str(weights) in message and "truncated or damaged" in message, message


def test_truncated_shard_is_named(checkpoint, tmp_path) -> None:
    path = _copy(checkpoint("gqa-llama3-tied-sharded"), tmp_path / "m")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = path / index["weight_map"]["model.norm.weight"]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptFileError) as info:
        load_model(path)
    assert str(shard) in str(info.value), info.value


@pytest.mark.parametrize(
    "weight_map", [[], {"model.norm.weight": 3}, {"model.norm.weight": None}, "x"]
)
def test_malformed_index_weight_map_is_a_config_error(checkpoint, tmp_path, weight_map) -> None:
    path = _copy(checkpoint("gqa-llama3-tied-sharded"), tmp_path / "m")
    index = path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ConfigError) as info:
        load_model(path)
    assert str(index) in str(info.value) and "weight_map" in str(info.value), info.value


def test_index_naming_the_wrong_shard_for_a_tensor(checkpoint, tmp_path) -> None:
    path = _copy(checkpoint("gqa-llama3-tied-sharded"), tmp_path / "m")
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    wrong = next(
        f for f in index["weight_map"].values() if f != index["weight_map"]["model.norm.weight"]
    )
    index["weight_map"]["model.norm.weight"] = wrong
    index_file.write_text(json.dumps(index))
    with pytest.raises(MissingTensorError) as info:
        load_model(path)
    message = str(info.value)
    assert "model.norm.weight" in message and wrong in message and str(index_file) in message


def test_sharded_checkpoint_has_several_files(checkpoint) -> None:
    path = checkpoint("gqa-llama3-tied-sharded")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "lm_head.weight" not in index["weight_map"]  # tied
    model, _ = load_model(path)
    assert model.lm_head.weight is model.embed_tokens.weight


def test_tp_must_divide_kv_heads(checkpoint) -> None:
    class ThreeRanks:
        world_size, rank = 3, 0

    config = load_config(checkpoint("gqa-llama3-tied-sharded"))
    with pytest.raises(ValueError, match="num_kv_heads=2 is not divisible by the TP degree 3"):
        LlamaModel(config, dtype="float32", device="meta", tp=ThreeRanks())


def test_tp_rank_gets_its_heads_mlp_rows_and_padded_vocabulary(checkpoint) -> None:
    """Rank 1 of 2: fused q/k/v of its heads, its MLP rows, half of a padded vocabulary."""

    class Rank1of2:  # loading never communicates, so a stand-in communicator will do
        world_size, rank = 2, 1

    path = checkpoint("gqa-llama3-tied-sharded")  # vocab 97 pads to 98; 4 q / 2 kv heads of 16
    config = load_config(path)
    full = {}
    for file in path.glob("*.safetensors"):
        full.update(load_file(file))
    model = LlamaModel(config, dtype="float32", device="meta", tp=Rank1of2())
    q, k, _ = weight_plan(model)["layers.0.self_attn.qkv_proj.weight"]
    assert (q.start, q.stop, k.start, k.stop) == (32, 64, 16, 32)
    load_weights(model, DictSource(full))
    attn = "model.layers.0.self_attn."
    expected_qkv = torch.cat(
        [
            full[attn + f"{name}_proj.weight"][rows:]
            for name, rows in (("q", 32), ("k", 16), ("v", 16))
        ]
    )
    assert torch.equal(model.layers["0"].self_attn.qkv_proj.weight, expected_qkv)
    o = model.layers["0"].self_attn.o_proj.weight
    assert torch.equal(o, full[attn + "o_proj.weight"][:, 32:])
    up = full["model.layers.0.mlp.up_proj.weight"][48:]
    assert torch.equal(model.layers["0"].mlp.gate_up_proj.weight[48:], up)
    emb = model.embed_tokens.weight
    assert emb.shape == (49, 64)
    assert torch.equal(emb[:48], full["model.embed_tokens.weight"][49:])
    assert not emb[48].any()  # the padding row
    assert model.lm_head.weight is emb


def test_load_weights_accepts_in_memory_tensors(checkpoint) -> None:
    path = checkpoint("mha-default-legacy")
    config = load_config(path)
    tensors = load_file(path / "model.safetensors")
    model = LlamaModel(config, dtype="float32", device="meta")
    load_weights(model, DictSource(tensors))
    reference, _ = load_model(path)
    for (name, a), (_, b) in zip(
        model.state_dict().items(), reference.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
