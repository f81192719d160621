"""tidal generate: JSONL rows and keys, greedy outputs equal transformers.generate, best-of-N
post-processors (rs, csft, iter_dpo) against the unprocessed scored samples, chunked writing, bad flags."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from tidal.cli.generate import main as generate_main
from tidal.cli.generate import parse_run
from tidal.cli.main import main as tidal_main
from tidal.inference.evaluation import pass_at_k_stats
from tidal.inference.generate import run_generate
from tidal.inference.processors import PromptGroup, make_post_processor
from tidal.inference.scoring import SampleScorer
from tidal.testing import AdditionTask, build_tiny_model

N_PROMPTS = 5


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return AdditionTask(seed=3).write_jsonl(tmp_path_factory.mktemp("gen") / "prompts.jsonl", N_PROMPTS)


def run(model, prompts, out, *extra) -> list[dict]:
    generate_main([
        "--pretrain", str(model), "--dataset", str(prompts), "--input_key", "prompt",
        "--output_path", str(out), "--max_new_tokens", "6", "--seed", "7", "--max_num_seqs", "16", *extra,
    ])  # fmt: skip
    return [json.loads(line) for line in out.read_text().splitlines()]


def by_prompt(rows: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["input"], []).append(row)
    return groups


def test_writes_n_times_k_rows_with_input_and_output(tiny_llama, prompts, tmp_path):
    # Through the `tidal` dispatcher, with --n_samples_per_prompt.
    out = tmp_path / "sub" / "samples.jsonl"
    tidal_main([
        "generate", "--pretrain", str(tiny_llama), "--dataset", str(prompts), "--input_key", "prompt",
        "--output_path", str(out), "--max_new_tokens", "6", "--n_samples_per_prompt", "3", "--max_num_seqs", "8",
    ])  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == N_PROMPTS * 3
    assert all(set(row) == {"input", "output"} for row in rows)
    expected = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines()]
    assert [row["input"] for row in rows] == [p for p in expected for _ in range(3)]


def test_scored_rows_have_rewards(tiny_llama, prompts, reward_model, tmp_path):
    rows = run(
        tiny_llama, prompts, tmp_path / "o.jsonl", "--best_of_n", "2", "--reward_pretrain", str(reward_model)
    )
    assert len(rows) == N_PROMPTS * 2
    assert all(set(row) == {"input", "output", "reward"} and isinstance(row["reward"], float) for row in rows)
    assert len({row["reward"] for row in rows}) > 1


@pytest.mark.parametrize("chat", [False, True])
def test_greedy_outputs_equal_transformers_generate(tiny_llama, prompts, tmp_path, chat):
    extra = ["--apply_chat_template"] if chat else []
    rows = run(tiny_llama, prompts, tmp_path / "g.jsonl", "--temperature", "0", "--max_samples", "3", *extra)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    questions = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines()][:3]
    assert len(rows) == 3 and all(row["output"] for row in rows)
    for question, row in zip(questions, rows, strict=True):
        if chat:  # HF's own tokenization of the chat prompt, independent of tidal's rendering rule
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=False
            )
        else:
            ids = tokenizer(question)["input_ids"]
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=6)
        assert row["output"] == tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def test_rs_and_iter_dpo_pick_best_and_worst_samples(tiny_llama, prompts, reward_model, tmp_path):
    flags = ["--best_of_n", "4", "--reward_pretrain", str(reward_model)]
    everything = by_prompt(run(tiny_llama, prompts, tmp_path / "all.jsonl", *flags))
    best = run(tiny_llama, prompts, tmp_path / "rs.jsonl", *flags, "--post_processor", "rs")
    pairs = run(tiny_llama, prompts, tmp_path / "dpo.jsonl", *flags, "--post_processor", "iter_dpo")
    assert len(best) == len(pairs) == N_PROMPTS
    for row in best:
        samples = everything[row["input"]]
        top = max(samples, key=lambda s: s["reward"])
        assert (row["output"], row["reward"]) == (top["output"], top["reward"])
    for pair in pairs:
        assert set(pair) == {"prompt", "chosen", "rejected", "chosen_reward", "rejected_reward"}
        rewards = {s["output"]: s["reward"] for s in everything[pair["prompt"]]}
        assert pair["chosen_reward"] >= pair["rejected_reward"]
        assert pair["chosen_reward"] == max(rewards.values()) == rewards[pair["chosen"]]
        assert pair["rejected_reward"] == min(rewards.values()) == rewards[pair["rejected"]]


def test_csft_writes_reward_tag_into_input(tiny_llama, prompts, reward_model, tmp_path):
    flags = ["--best_of_n", "2", "--reward_pretrain", str(reward_model), "--post_processor", "csft"]
    rows = run(tiny_llama, prompts, tmp_path / "c.jsonl", *flags)
    questions = {json.loads(line)["prompt"] for line in prompts.read_text().splitlines()}
    assert len(rows) == N_PROMPTS * 2
    for row in rows:
        question, tag = row["input"].split(" <rm_score>: ")
        assert question in questions and tag == f"{row['reward']:.1f} "
    custom = run(tiny_llama, prompts, tmp_path / "t.jsonl", *flags, "--reward_template", "[{reward}] {input}")
    assert all(row["input"].startswith(f"[{row['reward']:.1f}] ") for row in custom)


def test_csft_reward_conditions_the_prompts(tiny_llama, prompts, tmp_path):
    rows = run(tiny_llama, prompts, tmp_path / "c.jsonl", "--csft_reward", "5", "--max_samples", "2")
    assert len(rows) == 2 and all(row["input"].endswith("= <rm_score>: 5.0 ") for row in rows)


def test_reward_model_does_not_see_the_csft_tag(tiny_llama, prompts, reward_model, tmp_path, monkeypatch):
    seen = []
    score = SampleScorer.__call__
    monkeypatch.setattr(SampleScorer, "__call__", lambda self, seqs: seen.extend(seqs) or score(self, seqs))
    flags = ["--csft_reward", "5", "--reward_pretrain", str(reward_model), "--max_samples", "2"]
    rows = run(tiny_llama, prompts, tmp_path / "c.jsonl", *flags)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    assert len(seen) == len(rows) == 2
    for row, seq in zip(rows, seen, strict=True):
        ids = tokenizer(row["input"].removesuffix(" <rm_score>: 5.0 "))["input_ids"]
        assert seq[: len(ids)] == ids
        assert tokenizer.decode(seq[len(ids) :], skip_special_tokens=True) == row["output"]


def test_chunked_writing_gives_the_same_samples(tiny_llama, prompts, tmp_path):
    """--max_num_seqs 2 with K=2 runs the 5 prompts in chunks of 4: same rows as one chunk."""
    one = run(tiny_llama, prompts, tmp_path / "one.jsonl", "--best_of_n", "2")
    chunked = run(tiny_llama, prompts, tmp_path / "two.jsonl", "--best_of_n", "2", "--max_num_seqs", "2")
    assert chunked == one


def test_post_processors_on_ties():
    group = PromptGroup("p", ["a", "b", "c"], [1.0, 3.0, 3.0])
    assert make_post_processor("rs")(group) == [{"input": "p", "output": "b", "reward": 3.0}]
    pair = make_post_processor("iter_dpo")(PromptGroup("p", ["a", "b"], [2.0, 2.0]))[0]
    assert (pair["chosen"], pair["rejected"]) == ("a", "a")
    assert (
        make_post_processor("csft")(PromptGroup("q {x}", ["a"], [-0.26]))[0]["input"]
        == "q {x} <rm_score>: -0.3 "
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--post_processor", "rs"], "--post_processor rs needs --reward_pretrain"),
        (["--normalize_reward"], "--normalize_reward needs --reward_pretrain"),
        (["--micro_batch_size", "4"], "--micro_batch_size needs --reward_pretrain"),
        (
            ["--post_processor", "iter_dpo", "--reward_pretrain", "RM"],
            "--best_of_n (or --n_samples_per_prompt) >= 2",
        ),
        (["--post_processor", "best"], "invalid choice"),
        (
            ["--best_of_n", "9", "--max_num_seqs", "8"],
            "--best_of_n/--n_samples_per_prompt 9 exceeds --max_num_seqs 8",
        ),
        (["--top_p", "0"], "--top_p must be in (0, 1]"),
        (["--csft_reward", "1", "--reward_template", "{input}"], "--reward_template must contain {reward}"),
        (["--reward_template", "{input} {reward}"], "--reward_template is only used by"),
        (["--eval_task", "generate_vllm"], "OpenRLHF's modes (generate, generate_vllm)"),
        (["--eval_task", "t.py", "--reward_pretrain", "RM"], "--eval_task and --reward_pretrain"),
        (["--label_key", "label"], "--label_key is read by --eval_task"),
        (["--eval_pass_threshold", "0.5"], "--eval_pass_threshold needs --eval_task"),
    ],
)
def test_bad_flag_combinations_exit_2(tiny_llama, prompts, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exc:
        run(tiny_llama, prompts, tmp_path / "x.jsonl", *extra)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--input_key", "question"], "key 'question' not found"),
        (["--prompt_max_len", "2"], "longer than 2 tokens (--prompt_max_len)"),
    ],
)
def test_bad_data_and_models_exit_2(tiny_llama, prompts, reward_model, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exc:
        run(tiny_llama, prompts, tmp_path / "x.jsonl", "--reward_pretrain", str(reward_model), *extra)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_reward_model_with_another_tokenizer_is_rejected(tiny_llama, prompts, tmp_path, capsys):
    other = build_tiny_model(tmp_path / "other", "llama", vocab_size=300, seed=1)
    AutoModelForSequenceClassification.from_pretrained(str(other), num_labels=1).save_pretrained(other)
    with pytest.raises(SystemExit) as exc:
        run(tiny_llama, prompts, tmp_path / "x.jsonl", "--reward_pretrain", str(other))
    assert exc.value.code == 2
    assert "different tokenizer than --pretrain" in capsys.readouterr().err


def test_best_of_n_is_n_samples_per_prompt(tiny_llama, prompts, tmp_path):
    flags = ["--pretrain", str(tiny_llama), "--dataset", str(prompts), "--output_path", str(tmp_path / "o")]
    assert parse_run([*flags, "--best_of_n", "3"]).prompts.n_samples_per_prompt == 3


EVAL_TASK = """
import json, zlib
import torch

def reward_func(queries, prompts, labels):
    # deterministic 0/1 scores from the response text, rewards 10x; every call is recorded for the test
    scores = [float(zlib.crc32(q[len(p):].encode()) % 2) for q, p in zip(queries, prompts)]
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"prompts": prompts, "labels": labels, "scores": scores}}) + "\\n")
    return {{"rewards": 10 * torch.tensor(scores), "scores": torch.tensor(scores)}}
"""


def test_eval_task_reports_pass_at_k_and_mean_reward(tiny_llama, prompts, tmp_path):
    calls = tmp_path / "calls.jsonl"
    (tmp_path / "task.py").write_text(EVAL_TASK.format(log=str(calls)))
    out = tmp_path / "eval.jsonl"
    result = run_generate(parse_run([
        "--pretrain", str(tiny_llama), "--dataset", str(prompts), "--input_key", "prompt", "--label_key", "label",
        "--output_path", str(out), "--max_new_tokens", "6", "--seed", "7", "--n_samples_per_prompt", "4",
        "--max_num_seqs", "4", "--eval_task", str(tmp_path / "task.py"),
    ]))  # fmt: skip
    recorded = [json.loads(line) for line in calls.read_text().splitlines()]
    assert len(recorded) > 1  # --max_num_seqs 4 makes two chunks (4 prompts, then 1), each scored by the task
    scores = [s for call in recorded for s in call["scores"]]
    labels = [x for call in recorded for x in call["labels"]]
    expected = [json.loads(line)["label"] for line in prompts.read_text().splitlines()]
    assert labels == [x for x in expected for _ in range(4)]  # prompt-major, labels from --label_key
    assert 0 < sum(scores) < len(scores)  # the check below is not trivially all-pass or all-fail
    assert result.eval == pytest.approx(
        pass_at_k_stats(scores, 4) | {"reward": 10 * sum(scores) / len(scores)}
    )
    assert set(result.eval) == {"pass@1", "pass@4", "reward"}
    assert len(out.read_text().splitlines()) == N_PROMPTS * 4


def test_a_model_with_nan_weights_stops_with_one_line(nan_model, prompts, tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    with pytest.raises(SystemExit) as exc:
        run(nan_model, prompts, out)
    assert exc.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"tidal generate: error: --pretrain {nan_model}: the model's logits are not finite")
    assert not out.exists() or out.read_text() == ""  # no empty answers written
