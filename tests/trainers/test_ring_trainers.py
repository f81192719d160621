"""``--ring_attn_size 2`` (2 gloo processes) for the trainers whose losses read more than log-probs: the
reward model (last-token values), PRM (logits at the step tokens), KD (student and teacher logits), KTO
(its KL reference point's forwards) and PPO with a critic (GAE) match one process with
``--ring_attn_size 1`` to 1e-5, on packed rows of uneven lengths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from tidal.cli import train_kd, train_kto, train_prm, train_rm
from tidal.testing import AdditionTask, build_tiny_model, perturbed_copy
from tidal.trainers.kd import run_kd
from tidal.trainers.kto import run_kto
from tidal.trainers.prm import run_prm
from tidal.trainers.rm import run_rm

RUNNER = Path(__file__).with_name("ring_runner.py")
MARK = "ки"
RUNS = {
    "rm": (train_rm, run_rm),
    "prm": (train_prm, run_prm),
    "kd": (train_kd, run_kd),
    "kto": (train_kto, run_kto),
}
KEYS = {
    "rm": ("loss", "acc", "reward_gap", "chosen_reward", "grad_norm"),
    "prm": ("loss", "acc", "grad_norm"),
    "kd": ("loss", "teacher_kl", "grad_norm"),
    "kto": ("loss", "kl", "desirable_reward", "undesirable_reward", "grad_norm"),
    # GAE: the first rollout trains only the critic (--freezing_actor_steps 1), so its grad_norm is the critic's
    "ppo": ("reward", "critic/loss", "grad_norm", "values/mean", "advantages/abs_mean", "returns/mean", "kl",
            "policy/loss"),
}  # fmt: skip
# The pairwise loss ignores a shift of all rewards, so its gradient along that direction is rounding noise,
# which Adam scales up to a full step: at 2e-3 the rewards' mean (chosen_reward, the saved mean) drifts
# by ~2e-5 between any two exact runs; the RM trains slower.
LEARNING_RATE = {"rm": "2e-4"}
# extra flags of the ring runs: the RM recomputes its ring forwards in backward, KD fuses its head (one
# process does not), KTO passes 2 key/value heads at a time; PRM's ring path always runs its head at the
# step tokens only, one process takes the full logits
RING_EXTRA = {
    "rm": ["--gradient_checkpointing"],
    "prm": [],
    "kd": ["--use_liger_kernel"],
    "kto": ["--ring_head_stride", "2"],
}


def with_step_marker(folder: Path) -> Path:
    """A tiny Qwen2 whose tokenizer has the PRM step marker as one token."""
    path = build_tiny_model(folder, "qwen2", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.add_tokens([MARK])
    tokenizer.save_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path))
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(str(path))
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def datasets(folder: Path) -> dict[str, Path]:
    """Pairs, SFT rows, unpaired rows and PRM steps, all of uneven lengths."""
    samples = AdditionTask(digits=3, seed=5).samples(16)
    pairs = [
        {"prompt": s["prompt"], "chosen": s["answer"], "rejected": str(int(s["answer"]) * (7 + i) + 1)}
        for i, s in enumerate(samples)
    ]
    unpaired = [
        {"input": s["prompt"], "output": s["answer"] if i % 2 == 0 else str(int(s["answer"]) * (3 + i)),
         "label": i % 2 == 0}
        for i, s in enumerate(samples)
    ]  # fmt: skip
    steps = [
        {"input": "Solve: " + " ".join(f"{'a b' * (1 + (i + k) % 3)} {MARK}" for k in range(2 + i % 3)),
         "label": ["+" if (i + k) % 2 else "-" for k in range(2 + i % 3)]}
        for i in range(16)
    ]  # fmt: skip
    return {
        "pairs": write_jsonl(folder / "pairs.jsonl", pairs),
        "sft": AdditionTask(digits=3, seed=4).write_jsonl(folder / "sft.jsonl", 16),
        "unpaired": write_jsonl(folder / "unpaired.jsonl", unpaired),
        "steps": write_jsonl(folder / "steps.jsonl", steps),
    }


def flags(kind: str, models: dict, data: dict, out: Path, *extra: str) -> list[str]:
    model = models["prm" if kind == "prm" else "policy"]
    common = [
        "--pretrain", str(model), "--max_len", "64", "--train_batch_size", "4", "--micro_train_batch_size", "2",
        "--learning_rate", LEARNING_RATE.get(kind, "2e-3"), "--lr_warmup_ratio", "0", "--zero_stage", "2", "--seed", "5",
        "--max_samples", "8", "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"),
        "--packing_samples", *extra,
    ]  # fmt: skip
    own = {
        "rm": ["--dataset", str(data["pairs"]), "--prompt_key", "prompt", "--normalize_reward"],
        "prm": ["--dataset", str(data["steps"]), "--placeholder_token", MARK, "--reward_tokens", "+", "-"],
        "kd": ["--dataset", str(data["sft"]), "--input_key", "prompt", "--output_key", "answer",
               "--teacher_model", str(models["other"]), "--kd_coef", "0.6"],
        "kto": ["--dataset", str(data["unpaired"]), "--ref_pretrain", str(models["other"]), "--beta", "0.1"],
    }  # fmt: skip
    return [*common, *own[kind]]


def assert_same_steps(one: list[dict], two: list[dict], keys, kind: str) -> None:
    assert len(one) == len(two) >= 2
    for a, b in zip(one, two, strict=True):
        for key in keys:
            assert (key in a) == (key in b), (kind, key, a["step"])
            if key not in a:  # e.g. policy/loss while the policy is frozen
                continue
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-5), (kind, key, a["step"], a[key], b[key])


REWARD = """
import torch


def reward_func(queries, prompts, labels, **kwargs):
    values = [sum(ord(c) for c in q[len(p):]) % 7 / 7 for q, p in zip(queries, prompts)]
    return {"rewards": torch.tensor(values)}
"""


def ppo_flags(model: Path, folder: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--pretrain", str(model), "--prompt_data", str(folder / "prompts.jsonl"), "--input_key", "prompt",
        "--label_key", "label", "--remote_rm_url", str(folder / "reward.py"), "--n_samples_per_prompt", "2",
        "--rollout_batch_size", "4", "--train_batch_size", "8", "--micro_train_batch_size", "2",
        "--micro_rollout_batch_size", "2", "--generate_max_len", "4", "--prompt_max_len", "8",
        "--actor_learning_rate", "2e-3", "--critic_learning_rate", "2e-3", "--lr_warmup_ratio", "0",
        "--zero_stage", "2", "--seed", "3", "--advantage_estimator", "gae", "--init_kl_coef", "0.05",
        "--freezing_actor_steps", "1", "--packing_samples", "--max_samples", "8",
        "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"), *extra,
    ]  # fmt: skip


def write_prompts(folder: Path) -> None:
    with (folder / "prompts.jsonl").open("w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"{i % 10}+{i % 3}={'1' * (i % 4)}", "label": "x"}) + "\n")
    (folder / "reward.py").write_text(REWARD)


@pytest.fixture(scope="module")
def runs(tiny_llama, tiny_qwen2, tmp_path_factory, ranks) -> tuple[dict, Path]:
    """Each trainer with one process, then all of them with ``--ring_attn_size 2`` over 2 processes (one
    launch, which also runs the GAE ring with the critic on worker processes of its own, ``ppo_workers``,
    against the same one-process run): ``({kind: (one's history, the ring run's ring_runner output)},
    folder)``."""
    from tidal.cli.train_ppo import parse_run
    from tidal.trainers.ppo import run_ppo

    folder = tmp_path_factory.mktemp("ring_trainers")
    models = {
        "policy": tiny_llama,
        "other": perturbed_copy(tiny_llama, folder / "other", 0.05, seed=0),
        "prm": with_step_marker(folder / "prm_model"),
    }
    data = datasets(folder)
    write_prompts(folder)
    one = {
        kind: run(cli.parse_run(flags(kind, models, data, folder / f"{kind}1")))
        for kind, (cli, run) in RUNS.items()
    }
    one["ppo"] = run_ppo(parse_run(ppo_flags(tiny_qwen2, folder, folder / "ppo1")))
    argv = {
        kind: flags(kind, models, data, folder / f"{kind}2", "--ring_attn_size", "2", *RING_EXTRA[kind])
        for kind in RUNS
    }
    argv["ppo"] = ppo_flags(
        tiny_qwen2, folder, folder / "ppo2", "--ring_attn_size", "2", "--gradient_checkpointing"
    )
    # the critic on 2 worker processes of its own (see the last test); one["ppo"] is its one-process run too
    own = ("--actor_num_gpus_per_node", "2", "--critic_num_nodes", "1", "--critic_num_gpus_per_node", "2")
    argv["ppo_workers"] = ppo_flags(tiny_qwen2, folder, folder / "ppo_workers", "--ring_attn_size", "2", *own)
    one["ppo_workers"] = one["ppo"]
    specs = [
        {"kind": kind.removesuffix("_workers"), "out": str(folder / f"{kind}2.json"), "argv": argv[kind]}
        for kind in one
    ]
    (folder / "runs.json").write_text(json.dumps(specs))
    ranks.launch(RUNNER, folder / "runs.json")  # 2 processes (tests/trainers/conftest.py)
    return {kind: (one[kind], json.loads((folder / f"{kind}2.json").read_text())) for kind in one}, folder  # fmt: skip


@pytest.mark.parametrize("kind", [*RUNS, "ppo"])
def test_ring_of_two_matches_one_process(runs, kind):
    one, two = runs[0][kind]
    assert two["ring_layers"] > 0  # the models' attention layers ran as ring attention
    assert_same_steps(one, two["history"], KEYS[kind], kind)


def test_reward_statistics_take_ring_turns(runs):
    """``--normalize_reward``'s mean and std of the trained reward model, scored under the ring."""
    saved = [json.loads((runs[1] / f"rm{n}" / "final" / "config.json").read_text()) for n in (1, 2)]
    for key in ("mean", "std"):
        assert saved[1][key] == pytest.approx(saved[0][key], rel=1e-5, abs=1e-5)


def test_gae_first_step_trains_the_critic_alone(runs):
    """So that step's grad_norm compared above is the critic's (under ring: its values and update)."""
    one, two = runs[0]["ppo"]
    assert "policy/loss" not in one[0] and "policy/loss" in one[1]
    assert "critic/loss" in two["history"][0]


def test_ppo_gae_ring_with_critic_workers_matches_one_process(runs):
    """The critic on 2 worker processes of its own (``--critic_num_gpus_per_node 2``): the workers make
    their own ring group and take the trainers' turns; the steps are the colocated single process's."""
    one, two = runs[0]["ppo_workers"]
    assert_same_steps(one, two["history"], KEYS["ppo"], "ppo")
