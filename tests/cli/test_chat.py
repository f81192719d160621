"""tidal chat: a piped two-turn session through a subprocess keeps the history (the second greedy reply is
transformers' greedy continuation of the whole conversation), /reset forgets, and long histories are trimmed."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tidal.cli.chat import main as chat_main
from tidal.inference.chat import ChatConfig, ChatSession, run_chat
from tidal.rollout import EngineConfig, LLMEngine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


def hf_reply(model_path, messages: list[dict]) -> str:
    """transformers' greedy reply to a conversation, tokenized by HF's own chat template call."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    hf = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=6)
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True).strip()


def test_piped_session_keeps_history(tiny_llama):
    stdin = "12+34=\nhow are you\n/exit\nnever read\n"
    proc = subprocess.run(
        [sys.executable, "-m", "tidal.cli.chat", "--pretrain", str(tiny_llama), "--max_new_tokens", "6",
         "--temperature", "0", "--repetition_penalty", "1", "--system_prompt", "You add numbers."],
        input=stdin, capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    replies = [line.removeprefix("Assistant: ") for line in proc.stdout.splitlines()]
    assert len(replies) == 2 and proc.stdout.count("Assistant: ") == 2
    history = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "12+34="}]
    assert replies[0] == hf_reply(tiny_llama, history)
    history += [{"role": "assistant", "content": replies[0]}, {"role": "user", "content": "how are you"}]
    assert replies[1] == hf_reply(tiny_llama, history)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(
        tiny_llama, EngineConfig(device="cpu", dtype="float32", max_num_seqs=1, max_model_len=64)
    )


def test_reset_forgets_and_plain_template_renders_turns(engine):
    session = ChatSession(engine, GREEDY, ChatConfig(apply_chat_template="false"))
    stdout = io.StringIO()
    assert run_chat(session, io.StringIO("hi\nagain\n/reset\n\nlast\n"), stdout) == 3
    assert "(conversation reset)" in stdout.getvalue()
    assert [user for user, _ in session.turns] == ["last"]
    session.turns = [("hi", "hello")]
    assert session.render("bye") == "User: hi\nAssistant: hello\nUser: bye\nAssistant: "


def test_long_history_drops_oldest_turns(engine):
    session = ChatSession(engine, GREEDY, ChatConfig())
    session.turns = [(f"question {i} " * 3, "answer " * 3) for i in range(10)]
    session.reply("one more")
    assert session.dropped > 0 and session.turns[-1][0] == "one more"
    assert session.turns[0][0] == f"question {session.dropped} " * 3


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--input_template", "no slot"], "--input_template must contain '{}'"),
        (["--apply_chat_template", "maybe"], "invalid choice"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
    ],
)
def test_bad_flags_exit_2(tiny_llama, capsys, extra, message):
    with pytest.raises(SystemExit) as exc:
        chat_main(["--pretrain", str(tiny_llama), *extra])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_load_in_4bit_replies_from_an_nf4_model(tiny_llama):
    """``--load_in_4bit``: the chat runs on bitsandbytes NF4 layers through transformers, and its greedy
    reply is the 4-bit model's own greedy continuation of the rendered conversation."""
    bnb = pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    from tidal.inference.hf_generator import HFGenerator

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    generator = HFGenerator(str(tiny_llama), tokenizer, seed=0, device="cpu")
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in generator.model.modules())
    session = ChatSession(generator, GREEDY, ChatConfig(system_prompt="You add numbers."))
    reply = session.reply("12+34=")

    quant = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), quantization_config=quant, device_map="cpu")
    messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "12+34="}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=6)
    new = out[0, len(ids) :].tolist()
    if tokenizer.eos_token_id in new:
        new = new[: new.index(tokenizer.eos_token_id)]
    assert reply == tokenizer.decode(new, skip_special_tokens=True).strip()


def test_load_in_4bit_refuses_engine_options(tiny_llama, capsys):
    with pytest.raises(SystemExit) as exit_info:
        chat_main(["--pretrain", str(tiny_llama), "--load_in_4bit", "--tp_size", "2"])
    assert exit_info.value.code == 2
    assert "--load_in_4bit chats through transformers" in capsys.readouterr().err


def test_a_model_with_nan_weights_ends_the_chat(nan_model):
    from tidal.checkpoint import CheckpointError

    engine = LLMEngine(
        nan_model, EngineConfig(device="cpu", dtype="float32", max_num_seqs=1, max_model_len=64)
    )
    session = ChatSession(engine, GREEDY, ChatConfig(), model=str(nan_model))
    with pytest.raises(CheckpointError, match=rf"--pretrain {nan_model}: the model's logits are not finite"):
        run_chat(session, io.StringIO("hi\n"), io.StringIO())
