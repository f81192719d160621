"""``--ring_attn_size 2`` (ring attention over 2 CPU processes, gloo) trains SFT, DPO and GRPO exactly as
one process does with ``--ring_attn_size 1`` on packed rows of uneven lengths; impossible ring settings
fail with one line before any model loads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tidal.cli import train_dpo, train_sft
from tidal.cli.train_ppo import parse_run as parse_ppo
from tidal.config import ConfigError
from tidal.testing import AdditionTask
from tidal.trainers.dpo import run_dpo
from tidal.trainers.ppo import run_ppo
from tidal.trainers.sft import run_sft

RUNNER = Path(__file__).with_name("ring_runner.py")
# SFT also recomputes its ring forwards in backward (gradient checkpointing), DPO splits 2 heads per pass.
RING_EXTRA = {"sft": ["--gradient_checkpointing"], "dpo": ["--ring_head_stride", "2"]}
KEYS = {"sft": ("loss", "grad_norm"), "dpo": ("loss", "reward_margin", "grad_norm")}


def write_data(folder: Path) -> tuple[Path, Path]:
    sft = AdditionTask(digits=3, seed=4).write_jsonl(folder / "sft.jsonl", 16)
    pairs = folder / "pairs.jsonl"
    with pairs.open("w") as f:
        for i, s in enumerate(AdditionTask(digits=3, seed=5).samples(16)):
            wrong = str(int(s["answer"]) * (7 + i) + 1)  # rejected answers of uneven lengths
            f.write(json.dumps({"prompt": s["prompt"], "chosen": s["answer"], "rejected": wrong}) + "\n")
    return sft, pairs


def flags(kind: str, model: Path, data: dict, out: Path, *extra: str, packing: bool = True) -> list[str]:
    common = [
        "--pretrain", str(model), "--max_len", "64", "--train_batch_size", "4", "--micro_train_batch_size", "2",
        "--learning_rate", "2e-3", "--lr_warmup_ratio", "0", "--zero_stage", "2", "--seed", "5",
        "--max_samples", "8", "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"),
        *(["--packing_samples"] if packing else []), *extra,
    ]  # fmt: skip
    if kind == "dpo":
        return [*common, "--dataset", str(data["pairs"]), "--prompt_key", "prompt", "--beta", "0.1",
                "--ref_pretrain", str(data["reference"])]  # fmt: skip
    return [*common, "--dataset", str(data["sft"]), "--input_key", "prompt", "--output_key", "answer"]


@pytest.fixture(scope="module")
def ring_runs(tiny_llama, tiny_qwen2, perturbed_llama, tmp_path_factory, ranks) -> tuple[Path, dict]:
    """SFT, DPO and GRPO with ``--ring_attn_size 2`` in one 2-process launch (the processes start once),
    and their 1-process runs with ``--ring_attn_size 1``."""
    folder = tmp_path_factory.mktemp("ring")
    sft, pairs = write_data(folder)
    data = {"sft": sft, "pairs": pairs, "reference": perturbed_llama}
    one = {
        "sft": run_sft(train_sft.parse_run(flags("sft", tiny_llama, data, folder / "sft1"))),
        "dpo": run_dpo(train_dpo.parse_run(flags("dpo", tiny_llama, data, folder / "dpo1"))),
        "grpo": run_ppo(parse_ppo(grpo_flags(tiny_qwen2, folder, folder / "grpo1"))),
    }
    specs = [
        {"kind": kind, "out": str(folder / f"{kind}2.json"),
         "argv": flags(kind, tiny_llama, data, folder / f"{kind}2", "--ring_attn_size", "2", *RING_EXTRA[kind])}
        for kind in ("sft", "dpo")
    ]  # fmt: skip
    specs.append(
        {
            "kind": "ppo",
            "out": str(folder / "grpo2.json"),
            "argv": grpo_flags(tiny_qwen2, folder, folder / "grpo2", "--ring_attn_size", "2"),
        }
    )
    (folder / "runs.json").write_text(json.dumps(specs))
    ranks.launch(RUNNER, folder / "runs.json")
    return folder, one


def test_ring_of_two_matches_one_process(ring_runs):
    folder, one = ring_runs
    for kind in ("sft", "dpo"):
        two = json.loads((folder / f"{kind}2.json").read_text())
        assert two["ring_forwards"] > 0  # the packed forwards did run as ring attention
        assert len(one[kind]) == len(two["history"]) >= 2
        for a, b in zip(one[kind], two["history"], strict=True):
            for key in KEYS[kind]:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-5), (kind, key, a["step"])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--packing_samples", "--ring_attn_size", "2"],
            "--ring_attn_size 2 must divide the number of processes (1)",
        ),
        (["--ring_attn_size", "2", "--no_packing"], "--ring_attn_size 2 needs --packing_samples"),
        (
            ["--ring_attn_size", "2", "--ds_tensor_parallel_size", "2"],
            "--ds_tensor_parallel_size 2",
        ),
        (["--ring_attn_size", "0"], "--ring_attn_size must be >= 1, got 0"),
        (["--ring_head_stride", "0"], "--ring_head_stride must be >= 1, got 0"),
    ],
)
def test_impossible_ring_settings_fail_before_loading(tiny_llama, tmp_path, extra, message, monkeypatch):
    import tidal.trainers.common as common

    monkeypatch.setattr(common, "load_causal_lm", lambda *a, **k: pytest.fail("a model loaded"))
    packing = "--no_packing" not in extra
    extra = [f for f in extra if f != "--no_packing"]
    argv = flags("sft", tiny_llama, {"sft": tmp_path / "x.jsonl"}, tmp_path, *extra, packing=packing)
    with pytest.raises(ConfigError, match=re.escape(message)):
        run_sft(train_sft.parse_run(argv))


REWARD = """
import torch


def reward_func(queries, prompts, labels, **kwargs):
    values = [sum(ord(c) for c in q[len(p):]) % 7 / 7 for q, p in zip(queries, prompts)]
    return {"rewards": torch.tensor(values)}
"""


def grpo_flags(model: Path, folder: Path, out: Path, *extra: str) -> list[str]:
    """GRPO with a reference (KL loss), an entropy bonus and packed micro-batches; prompts of uneven
    lengths and ``reward.py`` are written under ``folder``."""
    with (folder / "prompts.jsonl").open("w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"{i % 10}+{i % 3}={'1' * (i % 4)}", "label": "x"}) + "\n")
    (folder / "reward.py").write_text(REWARD)
    return [
        "--pretrain", str(model), "--prompt_data", str(folder / "prompts.jsonl"), "--input_key", "prompt",
        "--label_key", "label", "--remote_rm_url", str(folder / "reward.py"), "--n_samples_per_prompt", "2",
        "--rollout_batch_size", "4", "--train_batch_size", "8", "--micro_train_batch_size", "2",
        "--micro_rollout_batch_size", "2", "--generate_max_len", "4", "--prompt_max_len", "8",
        "--actor_learning_rate", "2e-3", "--lr_warmup_ratio", "0", "--zero_stage", "2", "--seed", "3",
        "--advantage_estimator", "group_norm", "--init_kl_coef", "0.05", "--use_kl_loss",
        "--colocate_actor_ref", "--entropy_loss_coef", "0.01", "--packing_samples", "--max_samples", "8",
        "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"), *extra,
    ]  # fmt: skip


def test_grpo_ring_of_two_matches_one_process(ring_runs):
    """GRPO's scoring and updates under ring attention over 2 processes match one process."""
    folder, one = ring_runs
    two = json.loads((folder / "grpo2.json").read_text())
    assert two["ring_forwards"] > 0
    assert len(one["grpo"]) == len(two["history"]) >= 2
    for a, b in zip(one["grpo"], two["history"], strict=True):
        for key in ("reward", "policy/loss", "response_length", "grad_norm", "kl", "policy/kl_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-5), (key, a)


def test_ppo_impossible_ring_fails_before_loading(tiny_qwen2, tmp_path, monkeypatch):
    from tidal.cli.train_ppo import parse_run
    from tidal.trainers.ppo import entry, run_ppo

    monkeypatch.setattr(entry, "load_tokenizer", lambda *a, **k: pytest.fail("loading started"))
    argv = ["--pretrain", str(tiny_qwen2), "--prompt_data", str(tmp_path / "p.jsonl"), "--advantage_estimator", "gae",
            "--ring_attn_size", "2", "--packing_samples", "--save_path", str(tmp_path / "f")]  # fmt: skip
    with pytest.raises(ConfigError, match=r"--ring_attn_size 2 must divide the number of processes \(1\)"):
        run_ppo(parse_run(argv))
