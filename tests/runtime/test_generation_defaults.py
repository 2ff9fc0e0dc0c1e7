"""The model's generation_config.json supplies unset sampling fields (vLLM's
``--generation-config auto``)."""

from __future__ import annotations

import json

import pytest

from medha_runtime import LLM, SamplingParams
from medha_runtime.config import EngineConfig
from medha_runtime.generation_defaults import generation_defaults, read_generation_defaults
from medha_runtime.model import ConfigError, MissingFileError
from medha_runtime.model.tiny import save_tiny
from medha_sched import AffineCostModel

COST = AffineCostModel(base=1e-3, per_token=1e-5, per_attn=1e-9)


def _write(directory, data) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps(data), encoding="utf-8")


def test_the_sampling_keys_are_read_and_the_rest_left(tmp_path) -> None:
    _write(
        tmp_path,
        {
            "do_sample": False,
            "temperature": 0.6,
            "top_p": 0.9,
            "top_k": 40.0,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "max_new_tokens": 7,
            "eos_token_id": [1, 2],
            "max_length": 20,
        },
    )
    got = read_generation_defaults(tmp_path / "generation_config.json")
    assert got == {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "max_tokens": 7,
    }
    assert isinstance(got["top_k"], int) and isinstance(got["max_tokens"], int)
    assert generation_defaults(str(tmp_path), None) == got
    assert generation_defaults("auto", tmp_path) == got
    assert generation_defaults("vllm", tmp_path) == {}
    assert generation_defaults("auto", None) == {}
    assert generation_defaults("auto", tmp_path / "none") == {}


@pytest.mark.parametrize(
    "data,needle",
    [
        ({"temperature": "hot"}, "temperature must be a finite number, got 'hot'"),
        ({"top_p": True}, "top_p must be a finite number"),
        ({"top_k": 40.5}, "top_k must be a whole number, got 40.5"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens=0 is refused (max_tokens must be"),
    ],
)
def test_a_bad_value_names_the_file_and_key(tmp_path, data, needle: str) -> None:
    _write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        read_generation_defaults(tmp_path / "generation_config.json")
    assert needle in str(info.value) and "generation_config.json" in str(info.value)


def test_a_directory_without_the_file_and_a_bad_setting_are_refused(tmp_path) -> None:
    with pytest.raises(MissingFileError, match=r"no generation_config\.json"):
        EngineConfig(generation_config=str(tmp_path))
    with pytest.raises(ValueError, match="generation_config must be"):
        EngineConfig(generation_config="")


def test_llm_generates_with_the_models_defaults_unless_told_not_to(tmp_path) -> None:
    model = save_tiny(tmp_path / "tiny")
    _write(model, {"temperature": 0.0, "max_new_tokens": 3})
    prompt = [5, 6, 7, 8]
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with LLM(str(model), cost_model=COST, max_model_len=128) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.max_tokens) == (0.0, 3)
        want = llm.generate([prompt], greedy)[0].outputs[0].token_ids
        for _ in range(2):  # greedy: the same each time
            got = llm.generate([{"prompt_token_ids": prompt}])[0].outputs[0].token_ids
            assert got == want[: len(got)] and 1 <= len(got) <= 3
    with LLM(str(model), cost_model=COST, max_model_len=128, generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()


def test_values_equal_to_transformers_defaults_set_nothing(tmp_path) -> None:
    """vLLM reads the file through GenerationConfig.to_diff_dict: a stated default is no
    default of the request's (``"top_k": 50`` leaves top-k off)."""
    _write(tmp_path, {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0})
    assert read_generation_defaults(tmp_path / "generation_config.json") == {}
    _write(tmp_path, {"temperature": 0.7, "top_k": 40})
    got = read_generation_defaults(tmp_path / "generation_config.json")
    assert got == {"temperature": 0.7, "top_k": 40}
