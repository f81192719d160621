"""``tidal generate`` and ``tidal serve`` on a family outside the engine's registry (a tiny hybrid Mamba,
bamba): they run on the transformers fallback, say so in one line, and answer what
``transformers.generate`` answers greedily."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tidal.cli import serve as serve_cli
from tidal.cli.main import main as tidal_main
from tidal.testing.tiny import build_tiny_fallback_model

NOTICE = "bamba: not native to tidal's engine; generating with transformers (slower)"


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    return build_tiny_fallback_model(tmp_path_factory.mktemp("tiny_bamba"), "bamba", seed=0)


def hf_greedy_text(model_dir, prompt: str, max_new_tokens: int) -> str:
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens)
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def test_generate_runs_a_fallback_family(bamba, tmp_path, capfd):
    prompts = tmp_path / "prompts.jsonl"
    questions = ["the number of", "12+34="]
    prompts.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in questions))
    out = tmp_path / "samples.jsonl"
    tidal_main([
        "generate", "--pretrain", str(bamba), "--dataset", str(prompts), "--input_key", "prompt",
        "--output_path", str(out), "--max_new_tokens", "6", "--temperature", "0",
    ])  # fmt: skip
    assert NOTICE in capfd.readouterr().err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["input"] for row in rows] == questions
    for question, row in zip(questions, rows, strict=True):
        assert row["output"] and row["output"] == hf_greedy_text(bamba, question, 6)


def test_serve_answers_with_a_fallback_family(bamba):
    openai = pytest.importorskip("openai")
    pytest.importorskip("starlette")
    argv = ["--pretrain", str(bamba), "--port", "0", "--served_model_name", "m", "--max_model_len", "64"]
    server = serve_cli.build_server(*serve_cli.parse_configs(argv))
    with server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        r = client.completions.create(model="m", prompt="the number of", max_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5
    assert r.choices[0].text == hf_greedy_text(bamba, "the number of", 5)
