"""The seed README's rejection-sampling, conditional-SFT and iterative-DPO scripts, as OpenRLHF v0.9.2
wrote them (``examples/scripts/train_rejection_sampling_llama.sh``, ``train_conditional.sh``,
``train_iterative_dpo.sh``), run end to end on the CPU with tidal's modules.

Each step's flags are the script's own, in its order; only ``openrlhf`` becomes ``tidal`` in the module
paths, model and data paths point at tiny models and files, and size flags are small (``SIZES``). The
launcher (``python -m``, ``deepspeed --module``) becomes one in-process call of the module's ``main``:
one process, as ``deepspeed`` on one GPU, with the ``--local_rank=0`` that deepspeed's launcher appends.
One iteration of each loop. The scripts build each command as a string that the shell word-splits, so rejection sampling's ``--input_template ""`` arrives as the two
quote characters, and is passed so here.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

# OpenRLHF's size flags → the values these tests use (everything else is the script's).
SIZES = {
    "--max_new_tokens": "4",
    "--prompt_max_len": "32",
    "--max_len": "64",
    "--tp_size": "1",
    "--max_num_seqs": "4",
    "--rollout_batch_size": "3",
    "--micro_batch_size": "2",
    "--train_batch_size": "2",
    "--micro_train_batch_size": "1",
    "--best_of_n": "2",
    "--max_samples": "3",
}
QUESTIONS = ["1+1=", "2+3=", "4+4=", "5+1="]


def step(module: str, argv: list[str], launcher: str = "python") -> None:
    """``python -m <module> <argv>`` in this process, sizes made small (``openrlhf`` → ``tidal``);
    ``launcher="deepspeed"``: the scripts' ``deepspeed --module``, which appends ``--local_rank=0``."""
    argv = list(argv) + (["--local_rank=0"] if launcher == "deepspeed" else [])
    for i, token in enumerate(argv[:-1]):
        if token in SIZES:
            argv[i + 1] = SIZES[token]
    importlib.import_module(module.replace("openrlhf.", "tidal.", 1)).main(argv)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def prompt_collection(tmp_path_factory):
    """Rows shaped like OpenRLHF/prompt-collection-v0.1: ``context_messages``, a chat."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    lines = [json.dumps({"context_messages": [{"role": "user", "content": q}]}) for q in QUESTIONS]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def preferences(tmp_path_factory):
    """Rows shaped like OpenRLHF/preference_dataset_mixture2_and_safe_pku: chats ``chosen``/``rejected``."""
    path = tmp_path_factory.mktemp("prefs") / "prefs.jsonl"

    def chat(q, a):
        return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]

    lines = [json.dumps({"chosen": chat(q, "2"), "rejected": chat(q, "7")}) for q in QUESTIONS]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_rejection_sampling_llama(tiny_llama, reward_model, prompt_collection, tmp_path):
    generate, rm_out, model_out = tmp_path / "generate.jsonl", tmp_path / "rm.jsonl", tmp_path / "model"
    iteration, policy = 0, tiny_llama
    step("openrlhf.cli.batch_inference", [
        "--eval_task", "generate_vllm", "--pretrain", str(policy), "--param_dtype", "bf16",
        "--max_new_tokens", "2048", "--prompt_max_len", "2048", "--dataset", str(prompt_collection),
        "--input_key", "context_messages", "--apply_chat_template", "--temperature", "0.9",
        "--zero_stage", "0", "--best_of_n", "4", "--enable_prefix_caching", "--tp_size", "4",
        "--max_num_seqs", "64", "--iter", str(iteration), "--rollout_batch_size", "10240",
        "--output_path", str(generate),
    ])  # fmt: skip
    generated = rows(generate)
    assert len(generated) == 3 * 2 and {"input", "output"} <= set(generated[0])  # 3 prompts × best_of_n 2
    step("openrlhf.cli.batch_inference", [
        "--eval_task", "rm", "--pretrain", str(reward_model), "--param_dtype", "bf16", "--max_len", "4096",
        "--dataset", str(generate), "--dataset_probs", "1.0", "--zero_stage", "0", "--post_processor", "rs",
        "--micro_batch_size", "4", "--output_path", str(rm_out),
    ], "deepspeed")  # fmt: skip
    best = rows(rm_out)
    assert len(best) == 3 and all({"input", "output", "reward"} <= set(row) for row in best)
    for row in best:  # the kept sample is one of its prompt's samples
        assert row["output"] in [g["output"] for g in generated if g["input"] == row["input"]]
    step("openrlhf.cli.train_sft", [
        "--max_len", "4096", "--dataset", str(rm_out), "--dataset_probs", "1.0", "--train_batch_size", "128",
        "--micro_train_batch_size", "2", "--pretrain", str(policy), "--save_path", str(model_out),
        "--input_template", '""', "--zero_stage", "2", "--max_epochs", "1", "--param_dtype", "bf16",
        "--learning_rate", "2e-6", "--gradient_checkpointing",
    ], "deepspeed")  # fmt: skip
    assert (model_out / "config.json").exists() and (model_out / "model.safetensors").exists()


def test_conditional_sft(tiny_llama, reward_model, preferences, tmp_path):
    rm_out, model_out = tmp_path / "rm.jsonl", tmp_path / "model"
    step("openrlhf.cli.batch_inference", [
        "--eval_task", "rm", "--pretrain", str(reward_model), "--param_dtype", "bf16", "--max_len", "4096",
        "--dataset", str(preferences), "--input_key", "chosen", "--apply_chat_template",
        "--max_samples", "128000", "--zero_stage", "0", "--post_processor", "csft", "--normalize_reward",
        "--micro_batch_size", "4", "--output_path", str(rm_out),
    ], "deepspeed")  # fmt: skip
    scored = rows(rm_out)
    assert len(scored) == 3 and all({"input", "output", "reward"} <= set(row) for row in scored)
    for row in scored:  # the chosen chat's last turn is the response; its reward is in the prompt
        assert row["output"] == "2" and "<rm_score>" in row["input"]
    step("openrlhf.cli.train_sft", [
        "--max_len", "4096", "--dataset", str(rm_out), "--dataset_probs", "1.0", "--train_batch_size", "128",
        "--micro_train_batch_size", "2", "--pretrain", str(tiny_llama), "--save_path", str(model_out),
        "--zero_stage", "2", "--max_epochs", "1", "--param_dtype", "bf16", "--learning_rate", "5e-6",
        "--gradient_checkpointing",
    ], "deepspeed")  # fmt: skip
    assert (model_out / "config.json").exists() and (model_out / "model.safetensors").exists()


def test_iterative_dpo(tiny_llama, reward_model, prompt_collection, tmp_path):
    generate, rm_out, model_out = tmp_path / "generate.jsonl", tmp_path / "rm.jsonl", tmp_path / "checkpoint"
    iteration, policy = 0, tiny_llama
    step("openrlhf.cli.batch_inference", [
        "--eval_task", "generate_vllm", "--pretrain", str(policy), "--max_new_tokens", "2048",
        "--prompt_max_len", "2048", "--dataset", str(prompt_collection), "--input_key", "context_messages",
        "--apply_chat_template", "--temperature", "1.0", "--tp_size", "4", "--best_of_n", "8",
        "--enable_prefix_caching", "--max_num_seqs", "64", "--iter", str(iteration),
        "--rollout_batch_size", "10240", "--output_path", str(generate),
    ])  # fmt: skip
    assert len(rows(generate)) == 3 * 2
    step("openrlhf.cli.batch_inference", [
        "--eval_task", "rm", "--pretrain", str(reward_model), "--param_dtype", "bf16", "--max_len", "4096",
        "--dataset", str(generate), "--dataset_probs", "1.0", "--zero_stage", "0",
        "--post_processor", "iter_dpo", "--micro_batch_size", "4", "--output_path", str(rm_out),
    ], "deepspeed")  # fmt: skip
    pairs = rows(rm_out)
    assert len(pairs) == 3 and all({"prompt", "chosen", "rejected"} <= set(row) for row in pairs)
    assert all(row["chosen_reward"] >= row["rejected_reward"] for row in pairs)
    step("openrlhf.cli.train_dpo", [
        "--max_len", "4096", "--dataset", str(rm_out), "--dataset_probs", "1.0", "--prompt_key", "prompt",
        "--train_batch_size", "128", "--micro_train_batch_size", "2", "--pretrain", str(policy),
        "--ref_pretrain", str(policy), "--save_path", str(model_out), "--zero_stage", "3",
        "--max_epochs", "1", "--param_dtype", "bf16", "--learning_rate", "5e-7", "--gradient_checkpointing",
    ], "deepspeed")  # fmt: skip
    assert (model_out / "config.json").exists() and (model_out / "model.safetensors").exists()
