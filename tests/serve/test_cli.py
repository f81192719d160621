"""``tidal serve``'s flags and the server the command builds from them."""

from __future__ import annotations

import pytest

from tidal.cli import serve as serve_cli
from tidal.cli.main import usage
from tidal.config import ConfigError


def test_flags_and_listing(tiny_llama):
    model, serve = serve_cli.parse_configs(
        ["--pretrain", str(tiny_llama), "--port", "0", "--max_model_len", "64"]
    )
    assert (model.pretrain, serve.port, serve.max_model_len) == (str(tiny_llama), 0, 64)
    assert serve.model_name(model) == str(tiny_llama)
    assert "serve" in usage()
    with pytest.raises(ConfigError, match="--port must be in"):
        serve_cli.parse_configs(["--pretrain", str(tiny_llama), "--port", "70000"])
    limits = serve_cli.parse_configs(
        ["--pretrain", str(tiny_llama), "--max_request_bytes", "1024", "--max_request_samples", "4",
         "--request_timeout", "2.5"]
    )[1].limits  # fmt: skip
    assert (limits.max_request_bytes, limits.max_request_samples, limits.request_timeout) == (1024, 4, 2.5)
    with pytest.raises(ConfigError, match="--request_timeout"):
        serve_cli.parse_configs(["--pretrain", str(tiny_llama), "--request_timeout", "0"])
    with pytest.raises(SystemExit):  # a training flag is not a server flag
        serve_cli.parse_configs(["--pretrain", str(tiny_llama), "--lora_rank", "4"])


def test_bad_model_folder_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        serve_cli.main(["--pretrain", str(tmp_path / "missing")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("tidal serve: error: --pretrain") and err.count("\n") == 1


def test_built_server_answers(tiny_llama):
    openai = pytest.importorskip("openai")
    pytest.importorskip("starlette")
    argv = ["--pretrain", str(tiny_llama), "--port", "0", "--served_model_name", "m", "--max_model_len", "64"]
    server = serve_cli.build_server(*serve_cli.parse_configs(argv + ["--default_max_tokens", "3"]))
    with server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        r = client.completions.create(model="m", prompt="the")
    assert r.usage.completion_tokens == 3  # --default_max_tokens


def test_fp8_server_answers_as_the_fp8_engine(tiny_llama):
    # --quantization and --kv_cache_dtype (vLLM's names for --rollout_quantization and
    # --rollout_kv_cache_dtype): the FP8 engine answers, and the model card says so
    openai = pytest.importorskip("openai")
    pytest.importorskip("starlette")
    from tidal.rollout import EngineConfig, LLMEngine, SamplingParams

    argv = ["--pretrain", str(tiny_llama), "--port", "0", "--served_model_name", "m", "--max_model_len", "64"]
    model, serve = serve_cli.parse_configs(argv + ["--quantization", "fp8", "--kv_cache_dtype", "fp8"])
    assert serve.rollout_quantization == "fp8" and serve.rollout_kv_cache_dtype == "fp8"
    server = serve_cli.build_server(model, serve)
    with server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        card = client.models.retrieve("m")
        r = client.completions.create(model="m", prompt="the number of", max_tokens=5, temperature=0)
    assert card.model_extra["quantization"] == "fp8" and card.model_extra["kv_cache_dtype"] == "fp8"
    config = EngineConfig(quantization="fp8", kv_cache_dtype="fp8", max_model_len=64)
    engine = LLMEngine(str(tiny_llama), config)
    expected = engine.generate("the number of", SamplingParams(temperature=0, max_new_tokens=5))[0]
    assert r.choices[0].text == expected.outputs[0].text
