"""OpenRLHF v0.9.2's batch_inference and interactive_chat flags on ``tidal generate`` / ``tidal chat``:
``--repetition_penalty``, ``--enable_csft``/``--csft_prompt``, ``--iter``, ``--rollout_batch_size``,
``--output_key``, ``--ta_prompt``, ``--disable_fast_tokenizer`` and chat's OpenRLHF sampling defaults."""

from __future__ import annotations

import io
import json

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from tidal.cli.batch_inference import main as batch_main
from tidal.cli.chat import build_parser as chat_parser
from tidal.cli.chat import main as chat_main
from tidal.cli.generate import parse_run
from tidal.inference.chat import ChatConfig, ChatSession, run_chat
from tidal.rollout import EngineConfig, LLMEngine, SamplingParams
from tidal.testing import AdditionTask

N_PROMPTS = 5


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return AdditionTask(seed=3).write_jsonl(tmp_path_factory.mktemp("gen") / "prompts.jsonl", N_PROMPTS)


def questions(prompts) -> list[str]:
    return [json.loads(line)["prompt"] for line in prompts.read_text().splitlines()]


def run(model, prompts, out, *extra) -> list[dict]:
    """``python -m tidal.cli.batch_inference`` (OpenRLHF's name), greedy, 6 new tokens."""
    batch_main([
        "--eval_task", "generate_vllm", "--pretrain", str(model), "--dataset", str(prompts), "--input_key",
        "prompt", "--output_path", str(out), "--max_new_tokens", "6", "--greedy_sampling", *extra,
    ])  # fmt: skip
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_repetition_penalty_outputs_equal_transformers_generate(tiny_llama, prompts, tmp_path):
    rows = run(tiny_llama, prompts, tmp_path / "p.jsonl", "--repetition_penalty", "1.5", "--max_samples", "3")
    plain = run(tiny_llama, prompts, tmp_path / "q.jsonl", "--max_samples", "3")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    for question, row in zip(questions(prompts)[:3], rows, strict=True):
        ids = tokenizer(question)["input_ids"]
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=6, repetition_penalty=1.5)
        assert row["output"] == tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    assert rows != plain


def test_iter_selects_one_slice_of_rollout_batch_size_prompts(tiny_llama, prompts, tmp_path):
    rows = run(tiny_llama, prompts, tmp_path / "i.jsonl", "--iter", "1", "--rollout_batch_size", "2")
    assert [row["input"] for row in rows] == questions(prompts)[2:4]
    last = run(tiny_llama, prompts, tmp_path / "l.jsonl", "--iter", "2", "--rollout_batch_size", "2")
    assert [row["input"] for row in last] == questions(prompts)[4:]  # a short last slice
    assert parse_run(
        ["--pretrain", "m", "--dataset", "d", "--output_path", "o", "--iter", "3"]
    ).prompts.iter_rows == (range(3 * 2048, 4 * 2048))  # OpenRLHF's default slice


def test_iter_past_the_data_is_one_line(tiny_llama, prompts, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        run(tiny_llama, prompts, tmp_path / "x.jsonl", "--iter", "3", "--rollout_batch_size", "2")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--iter 3 selects rows 6..7" in err and "has 5 rows" in err and len(err.splitlines()) == 1


def test_rollout_batch_size_is_the_prompts_per_engine_call(tiny_llama, prompts, tmp_path, monkeypatch):
    default = run(tiny_llama, prompts, tmp_path / "a.jsonl")
    calls = []
    generate = LLMEngine.generate
    monkeypatch.setattr(
        LLMEngine, "generate", lambda self, ids, p: calls.append(len(ids)) or generate(self, ids, p)
    )
    chunked = run(tiny_llama, prompts, tmp_path / "b.jsonl", "--rollout_batch_size", "2")
    assert calls == [2, 2, 1]
    assert chunked == default  # the samples do not depend on the chunking


def test_enable_csft_appends_the_csft_prompt(tiny_llama, prompts, tmp_path):
    rows = run(
        tiny_llama, prompts, tmp_path / "c.jsonl", "--enable_csft", "--csft_prompt", " <rm_score>: 9.00 "
    )
    assert [row["input"] for row in rows] == [q + "<rm_score>: 9.00 " for q in questions(prompts)]
    default = run(tiny_llama, prompts, tmp_path / "d.jsonl", "--enable_csft", "--max_samples", "1")
    assert default[0]["input"] == questions(prompts)[0] + "<rm_score>: 5.00 "


def test_output_key_names_the_response(tiny_llama, prompts, tmp_path):
    rows = run(tiny_llama, prompts, tmp_path / "k.jsonl", "--output_key", "response", "--max_samples", "2")
    assert [set(row) for row in rows] == [{"input", "response"}] * 2


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--csft_prompt", "x"], "--csft_prompt is appended to the prompts by --enable_csft"),
        (["--enable_csft", "--csft_reward", "5"], "--enable_csft (a fixed --csft_prompt) and --csft_reward"),
        (["--repetition_penalty", "0"], "--repetition_penalty must be > 0"),
        (["--iter", "-1"], "--iter must be >= 0"),
        (["--rollout_batch_size", "0"], "--rollout_batch_size must be >= 1"),
        (["--output_key", "r", "--post_processor", "iter_dpo", "--best_of_n", "2", "--reward_pretrain", "R"],
         "--output_key: --post_processor iter_dpo"),
    ],
)  # fmt: skip
def test_bad_flags_exit_2_before_loading(tiny_llama, prompts, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exc:
        run(tiny_llama, prompts, tmp_path / "x.jsonl", *extra)
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()


def test_disable_fast_tokenizer_asks_for_the_slow_tokenizer(tiny_llama, prompts, tmp_path, monkeypatch):
    calls = []
    load = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(
        transformers.AutoTokenizer,
        "from_pretrained",
        lambda path, **kw: calls.append(kw.get("use_fast")) or load(path, **kw),
    )
    run(tiny_llama, prompts, tmp_path / "s.jsonl", "--disable_fast_tokenizer", "--max_samples", "1")
    assert calls[0] is False


# ---------------------------------------------------------------- chat


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(
        tiny_llama, EngineConfig(device="cpu", dtype="float32", max_num_seqs=1, max_model_len=64)
    )


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4)


def test_ta_prompt_opens_the_plain_conversation(engine, tmp_path):
    preamble = tmp_path / "ta.txt"
    preamble.write_text("You are a calculator.")
    cfg = ChatConfig(apply_chat_template="false", ta_prompt=str(preamble), enable_csft=True)
    session = ChatSession(engine, GREEDY, cfg)
    assert session.render("1+1") == "You are a calculator.\nUser: 1+1\nAssistant: <rm_score>: 5.00 "
    run_chat(session, io.StringIO("hi\n/reset\n"), io.StringIO())
    assert session.render("2").startswith("You are a calculator.\n")  # /reset keeps the preamble


def test_csft_prompt_follows_the_chat_template(engine):
    session = ChatSession(engine, GREEDY, ChatConfig(enable_csft=True, csft_prompt="<q>"))
    assert session.use_template and session.render("hi").endswith("<q> ")


def test_ta_prompt_with_a_chat_template_is_refused(tiny_llama, tmp_path, capsys):
    preamble = tmp_path / "ta.txt"
    preamble.write_text("x")
    with pytest.raises(SystemExit) as exc:
        chat_main(
            ["--pretrain", str(tiny_llama), "--ta_prompt", str(preamble)], prog="tidal interactive_chat"
        )
    assert exc.value.code == 2
    assert "--ta_prompt opens a plain-text conversation" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        chat_main(["--pretrain", str(tiny_llama), "--ta_prompt", str(tmp_path / "missing.txt")])
    assert "--ta_prompt" in capsys.readouterr().err


def test_chat_sampling_defaults_are_openrlhf_interactive_chats():
    ns = chat_parser().parse_args(["--pretrain", "m"])
    assert (ns.temperature, ns.top_p, ns.repetition_penalty) == (0.2, 0.9, 1.2)


# ---------------------------------------------------------------- batch_inference --eval_task rm


SAMPLES = [("1+1=", "2"), ("1+1=", "11"), ("2+3=", "5"), ("1+1=", "3"), ("2+3=", "6")]


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    """A file as ``tidal generate --best_of_n`` writes it: several responses per prompt."""
    path = tmp_path_factory.mktemp("rmdata") / "samples.jsonl"
    path.write_text("".join(json.dumps({"input": p, "response": r}) + "\n" for p, r in SAMPLES))
    return path


def hf_reward(model_path, text: str) -> float:
    """The value head at the last token of ``text`` (+ eos), from transformers directly."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    hf = AutoModelForSequenceClassification.from_pretrained(str(model_path), dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer(text + tokenizer.eos_token)["input_ids"]])
    with torch.no_grad():
        return hf.score(hf.model(ids).last_hidden_state)[0, -1, 0].item()


def score(reward_model, samples, out, *extra) -> list[dict]:
    batch_main([
        "--eval_task", "rm", "--pretrain", str(reward_model), "--dataset", str(samples), "--output_key",
        "response", "--output_path", str(out), "--micro_batch_size", "2", *extra,
    ])  # fmt: skip
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_rm_mode_scores_every_response_of_the_file(reward_model, samples, tmp_path):
    rows = score(reward_model, samples, tmp_path / "r.jsonl")
    assert [(row["input"], row["response"]) for row in rows] == [  # grouped by prompt, file order within
        SAMPLES[0],
        SAMPLES[1],
        SAMPLES[3],
        SAMPLES[2],
        SAMPLES[4],
    ]
    for row in rows:
        assert row["reward"] == pytest.approx(
            hf_reward(reward_model, row["input"] + row["response"]), abs=1e-4
        )


def test_rm_mode_rejection_sampling_keeps_the_best_response_per_prompt(reward_model, samples, tmp_path):
    scored = score(reward_model, samples, tmp_path / "all.jsonl")
    best = score(reward_model, samples, tmp_path / "rs.jsonl", "--post_processor", "rs")
    assert [row["input"] for row in best] == ["1+1=", "2+3="]
    for row in best:
        assert row["reward"] == max(r["reward"] for r in scored if r["input"] == row["input"])
    pairs = score(reward_model, samples, tmp_path / "dpo.jsonl", "--post_processor", "iter_dpo")
    assert [(p["chosen_reward"] >= p["rejected_reward"]) for p in pairs] == [True, True]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--best_of_n", "2"], "--n_samples_per_prompt has no meaning with --eval_task rm"),
        (["--temperature", "0.5"], "--temperature has no meaning with --eval_task rm"),
        (["--reward_pretrain", "R"], "--reward_pretrain has no meaning with --eval_task rm"),
        (["--reward_template", "{input}{reward}"], "--reward_template is only used by --post_processor csft"),
    ],
)
def test_rm_mode_refuses_sampling_flags_in_one_line(reward_model, samples, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exc:
        score(reward_model, samples, tmp_path / "x.jsonl", *extra)
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()


def test_rm_mode_names_a_row_without_the_response_key(reward_model, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"input": "a", "response": "b"}) + "\n" + json.dumps({"input": "a"}) + "\n")
    with pytest.raises(SystemExit) as exc:
        score(reward_model, data, tmp_path / "x.jsonl")
    assert exc.value.code == 2 and "row 2 of" in capsys.readouterr().err
