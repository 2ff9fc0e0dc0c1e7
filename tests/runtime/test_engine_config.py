"""EngineConfig: validation messages, keyword building, resolution against a model, the CLI."""

from __future__ import annotations

import pytest

from medha_runtime.cli import build_parser, engine_config
from medha_runtime.config import EngineConfig
from medha_runtime.model.tiny import tiny_config


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 0}, "tp must be an integer >= 1, got 0"),
        ({"num_threads": 0}, "num_threads must be an integer >= 1, got 0"),
        ({"dtype": "float8"}, "unsupported dtype 'float8'"),
        ({"policy": "nope"}, "unknown policy 'nope'"),
        ({"device": "tpu"}, "device must be 'cpu' or 'cuda', got 'tpu'"),
        ({"kv_cache_tokens": 8}, "kv_cache_tokens must be an integer >= 16, got 8"),
        ({"kvp_group_tokens": 40}, "kvp_group_tokens=40 must be a multiple of block_size=16"),
        ({"target_batch_time": 0}, "target_batch_time must be a number > 0, got 0"),
        ({"timeout_s": None}, "timeout_s must be a finite number > 0, got None"),
        ({"timeout_s": float("inf")}, "timeout_s must be a finite number > 0, got inf"),
        ({"enable_prefix_caching": 1}, "enable_prefix_caching must be True or False, got 1"),
    ],
)
def test_bad_values_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(**kwargs)


def test_build_refuses_unknown_and_mixed_arguments() -> None:
    with pytest.raises(ValueError, match=r"unknown engine argument.s. num_thread;"):
        EngineConfig.build("tiny", num_thread=2)
    config = EngineConfig(model="tiny", kvp=2)
    assert EngineConfig.build(config) is config
    with pytest.raises(ValueError, match="not both"):
        EngineConfig.build(config, tp=2)
    assert EngineConfig.build("tiny", kvp=2) == config
    with pytest.raises(Exception, match=r"frozen|cannot assign"):
        config.kvp = 1  # type: ignore[misc]


def test_resolve_sizes_kv_and_carries_threads() -> None:
    config = EngineConfig(
        model="tiny",
        kvp=2,
        max_model_len=4096,
        kv_cache_tokens=4096,
        num_threads=3,
        seed=7,
        device="cpu",
    )
    r = config.resolve(tiny_config(), model_path="/models/tiny")
    assert r.max_model_len == 4096
    assert r.cache.max_tokens_per_group == 2048  # the context over kvp, whole blocks
    assert r.cache.num_blocks_per_group == 4096 // 16
    assert r.spec.model == "/models/tiny"
    assert (r.spec.kvp, r.spec.num_threads, r.num_threads) == (2, 3, 3)
    assert r.scheduler_config.policy == "lars-mp"
    with pytest.raises(ValueError, match="max_model_len=4096 does not fit"):
        EngineConfig(kv_cache_tokens=1024, max_model_len=4096).resolve(tiny_config())


def test_cuda_ranks_need_one_gpu_each(monkeypatch) -> None:
    """device='cuda' (the default where CUDA is available) wants a GPU per local rank."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    config = EngineConfig(
        model="tiny", kvp=2, max_model_len=4096, kv_cache_tokens=4096, device="cuda"
    )
    with pytest.raises(ValueError, match="2 ranks on this node need as many GPUs; 1 are visible"):
        config.resolve(tiny_config())
    one = EngineConfig(model="tiny", kv_cache_tokens=4096, device="cuda").resolve(tiny_config())
    assert one.spec.device == "cuda"


def test_serve_flags_build_the_config() -> None:
    args = build_parser().parse_args(
        ["serve", "tiny", "--num-threads", "3", "--kvp", "2", "--no-enable-prefix-caching"]
    )
    config = engine_config(args, distributed=None)
    assert (config.num_threads, config.kvp, config.enable_prefix_caching) == (3, 2, False)
    default = engine_config(build_parser().parse_args(["serve"]), distributed=None)
    assert (default.num_threads, default.enable_prefix_caching) == (None, True)


def test_chat_template_is_checked_when_made_and_resolved_to_its_text(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"missing\.jinja.*no such file"):
        EngineConfig(chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not compile"):
        EngineConfig(chat_template="{{ unclosed")
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}", encoding="utf-8")
    resolved = EngineConfig(chat_template=path).resolve(tiny_config())
    assert resolved.chat_template == "{{ messages[0]['content'] }}"
    assert EngineConfig().resolve(tiny_config()).chat_template is None


def test_serve_takes_chat_template_and_max_num_seqs(tmp_path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}", encoding="utf-8")
    args = build_parser().parse_args(
        ["serve", "tiny", "--chat-template", str(path), "--max-num-seqs", "3"]
    )
    config = engine_config(args, distributed=None)
    assert config.chat_template == str(path)
    assert config.max_batch_requests == 3
    args = build_parser().parse_args(["serve", "tiny", "--max-batch-requests", "5"])
    assert engine_config(args, distributed=None).max_batch_requests == 5
