"""Tensor-parallel training (``--ds_tensor_parallel_size 2``, DTensor TP inside FSDP2, CPU gloo) matches
one process step by step for SFT, DPO, KTO, KD, a reward model and PPO with a critic (its engine syncs
checked), also on a 2 x 2 mesh and for each plan style; its DCP checkpoints reshard (a TP=2 checkpoint
resumes with TP=1, in 2 data-parallel processes and in 1, and a 1-process checkpoint resumes with TP=2);
the HF export holds the full weights; impossible layouts fail before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tidal.cli import train_dpo, train_kd, train_kto, train_ppo, train_rm, train_sft
from tidal.config import ConfigError
from tidal.distributed.tensor_parallel import layout_problems, matching_modules, tp_plan
from tidal.distributed.world import World
from tidal.testing import AdditionTask, build_tiny_model
from tidal.testing.tiny import tiny_config
from tidal.trainers.dpo import run_dpo
from tidal.trainers.kd import run_kd
from tidal.trainers.kto import run_kto
from tidal.trainers.ppo import run_ppo
from tidal.trainers.rm import run_rm
from tidal.trainers.sft import run_sft

TP2 = ["--ds_tensor_parallel_size", "2"]


def sft_flags(model: Path, data: Path, out: Path, *extra) -> list[str]:
    return [
        "--pretrain", str(model), "--dataset", str(data), "--input_key", "prompt", "--output_key", "answer",
        "--max_len", "64", "--train_batch_size", "8", "--micro_train_batch_size", "2", "--max_samples", "16",
        "--learning_rate", "2e-3", "--lr_warmup_ratio", "0", "--zero_stage", "3", "--seed", "5",
        "--save_steps", "2", "--max_ckpt_num", "5",
        "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"), *extra,
    ]  # fmt: skip


def grpo_flags(model: Path, data: Path, out: Path, *extra) -> list[str]:
    """2 rollouts of 4 prompts x 4 samples; one optimizer step per rollout."""
    return [
        "--pretrain", str(model), "--prompt_data", str(data / "prompts.jsonl"), "--input_key", "prompt",
        "--label_key", "label", "--remote_rm_url", str(data / "reward.py"), "--n_samples_per_prompt", "4",
        "--rollout_batch_size", "4", "--train_batch_size", "16", "--micro_train_batch_size", "4",
        "--micro_rollout_batch_size", "4", "--generate_max_len", "4", "--prompt_max_len", "8",
        "--actor_learning_rate", "2e-3", "--lr_warmup_ratio", "0", "--zero_stage", "3", "--seed", "3",
        "--temperature", "1.0", "--advantage_estimator", "group_norm", "--init_kl_coef", "0",
        "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"), *extra,
    ]  # fmt: skip


REWARD = """
import torch


def reward_func(queries, prompts, labels, **kwargs):
    values = [sum(ord(c) for c in q[len(p):]) % 7 / 7 for q, p in zip(queries, prompts)]
    return {"rewards": torch.tensor(values)}
"""


def write_rl_data(folder: Path) -> Path:
    with (folder / "prompts.jsonl").open("w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"{i % 10}+{i % 3}=", "label": str(i % 10 + i % 3)}) + "\n")
    (folder / "reward.py").write_text(REWARD)
    return folder


def max_param_diff(a: Path, b: Path) -> float:
    ma, mb = AutoModelForCausalLM.from_pretrained(a), AutoModelForCausalLM.from_pretrained(b)
    pb = dict(mb.named_parameters())
    return max(float((p - pb[n]).detach().abs().max()) for n, p in ma.named_parameters())


def resume_flags(model: Path, sft: Path, ckpt_from: Path, out: Path, *extra) -> list[str]:
    """SFT from the step-2 checkpoint under ``ckpt_from`` (its ``latest`` truncated to step 2)."""
    return sft_flags(model, sft, out, "--load_checkpoint", "--ckpt_path", str(ckpt_from / "ckpt"),
                     "--save_steps", "-1", *extra)  # fmt: skip


def reshard_case(model: Path, folder: Path) -> tuple[dict, list[dict]]:
    """SFT under TP=2 (checkpoints every 2 steps) and its 1-process run; the TP=2 step-2 checkpoint
    resumed with TP=1 in 2 data-parallel processes, and the 1-process one resumed with TP=2."""
    sft = AdditionTask(digits=2, seed=4).write_jsonl(folder / "sft.jsonl", 40)
    one = {"sft": run_sft(train_sft.parse_run(sft_flags(model, sft, folder / "one")))}
    tp2 = folder / "tp2"
    specs = [
        {"kind": "sft", "out": str(folder / "tp2.json"), "argv": sft_flags(model, sft, tp2, *TP2)},
        {"kind": "truncate", "ckpt": str(tp2 / "ckpt"), "step": 2},
        {"kind": "sft", "out": str(folder / "tp2_to_dp2.json"), "argv": resume_flags(model, sft, tp2, folder / "dp2")},
        {"kind": "truncate", "ckpt": str(folder / "one" / "ckpt"), "step": 2},
        {"kind": "sft", "out": str(folder / "one_to_tp2.json"),
         "argv": resume_flags(model, sft, folder / "one", folder / "tp2b", *TP2)},
    ]  # fmt: skip
    return one, specs


# The 1-process counterpart of each trainer's TP=2 run, and the metrics compared per step.
RUNS = {"dpo": (train_dpo, run_dpo), "rm": (train_rm, run_rm), "kto": (train_kto, run_kto),
        "kd": (train_kd, run_kd), "ppo": (train_ppo, run_ppo)}  # fmt: skip
KEYS = {
    "dpo": ("loss", "reward_margin", "grad_norm"),
    "rm": ("loss", "acc", "reward_gap", "grad_norm"),
    "kto": ("loss", "kl", "grad_norm"),
    "kd": ("loss", "grad_norm"),
    "ppo": ("reward", "policy/loss", "critic/loss", "response_length", "grad_norm"),
}


def trainers_case(llama: Path, qwen2: Path, folder: Path) -> tuple[dict, list[dict]]:
    """DPO, a reward model, KTO and KD on the Llama model; PPO with GAE on the Qwen2 model (tied
    embeddings: the weight sync gathers the shared embedding/head), its syncs checked."""
    pairs, unpaired = folder / "pairs.jsonl", folder / "unpaired.jsonl"
    with pairs.open("w") as p, unpaired.open("w") as u:
        for i, s in enumerate(AdditionTask(digits=2, seed=5).samples(16)):
            wrong = str(int(s["answer"]) + 1 + i % 5)
            p.write(json.dumps({"prompt": s["prompt"], "chosen": s["answer"], "rejected": wrong}) + "\n")
            good = i % 2 == 0
            row = {"input": s["prompt"], "output": s["answer"] if good else wrong, "label": good}
            u.write(json.dumps(row) + "\n")
    sft = AdditionTask(digits=2, seed=4).write_jsonl(folder / "sft.jsonl", 16)
    rl = write_rl_data(folder)

    def common(out: Path) -> list[str]:
        return [
            "--pretrain", str(llama), "--max_len", "64", "--train_batch_size", "8",
            "--micro_train_batch_size", "2", "--learning_rate", "2e-3", "--lr_warmup_ratio", "0",
            "--zero_stage", "2", "--seed", "5", "--max_epochs", "1",
            "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"),
        ]  # fmt: skip

    data = {
        "dpo": ["--dataset", str(pairs), "--prompt_key", "prompt"],
        "rm": ["--dataset", str(pairs), "--prompt_key", "prompt"],
        "kto": ["--dataset", str(unpaired), "--input_template", "{}"],
        "kd": ["--dataset", str(sft), "--input_key", "prompt", "--output_key", "answer",
               "--teacher_model", str(llama)],
    }  # fmt: skip
    gae = ["--advantage_estimator", "gae", "--critic_learning_rate", "2e-3", "--n_samples_per_prompt", "2",
           "--train_batch_size", "8"]  # fmt: skip
    argv = {kind: [*common(folder / f"{kind}_N_"), *extra] for kind, extra in data.items()}  # _N_: 1 or 2
    argv["ppo"] = grpo_flags(qwen2, rl, folder / "gae_N_", *gae)
    one = {k: run(cli.parse_run([a.replace("_N_", "1") for a in argv[k]])) for k, (cli, run) in RUNS.items()}
    specs = [
        {"kind": k, "out": str(folder / f"{k}2.json"), "check_sync": k == "ppo",
         "argv": [*(a.replace("_N_", "2") for a in argv[k]), *TP2]}
        for k in RUNS
    ]  # fmt: skip
    return one, specs


# The plan styles beyond plain column/row splits (llama, qwen2 above): per-head q/k norms (qwen3),
# gathered q/k/v before a whole-width norm (olmo2), fused qkv and gate_up projections gathered whole (phi3).
FAMILIES = ("qwen3", "olmo2", "phi3")


def families_case(folder: Path) -> tuple[dict, list[dict]]:
    sft = AdditionTask(digits=2, seed=4).write_jsonl(folder / "sft.jsonl", 16)
    one, specs = {}, []
    for family in FAMILIES:
        model = build_tiny_model(folder / family, family, seed=0)
        flags = sft_flags(model, sft, folder / f"{family}1", "--save_steps", "-1", "--max_epochs", "1")
        one[family] = run_sft(train_sft.parse_run(flags))
        argv = sft_flags(model, sft, folder / f"{family}2", "--save_steps", "-1", "--max_epochs", "1", *TP2)
        specs.append({"kind": "sft", "out": str(folder / f"{family}2.json"), "argv": argv})
    return one, specs


@pytest.fixture(scope="module")
def tp2_runs(tiny_qwen2, tiny_llama, tmp_path_factory, dist) -> dict[str, tuple[Path, dict]]:
    """Every 2-process run of the tests below in one torchrun launch (the processes start once), each
    case in a folder of its own, with the 1-process runs each case compares against."""
    folders = {name: tmp_path_factory.mktemp(name) for name in ("reshard", "trainers", "families")}
    cases = {
        "reshard": reshard_case(tiny_qwen2, folders["reshard"]),
        "trainers": trainers_case(tiny_llama, tiny_qwen2, folders["trainers"]),
        "families": families_case(folders["families"]),
    }
    specs = [spec for _, specs in cases.values() for spec in specs]
    dist.torchrun(specs, folders["reshard"], timeout=600, fork=True)
    return {name: (folders[name], one) for name, (one, _) in cases.items()}


def test_tp2_matches_one_process_and_checkpoints_reshard(tiny_qwen2, tp2_runs, dist):
    folder, one = tp2_runs["reshard"]
    one = one["sft"]
    tp2 = folder / "tp2"
    two = dist.result(folder / "tp2.json")["history"]
    assert len(two) == 4
    dist.assert_steps_match(one, two, ("loss", "grad_norm", "tokens"))
    # The export holds the full tensors (it loads), equal to the 1-process run's up to Adam's amplification
    # of the float rounding differences of the sharded matmuls (4 steps at lr 2e-3).
    assert max_param_diff(folder / "one" / "final", tp2 / "final") < 1e-4

    for resumed in ("tp2_to_dp2", "one_to_tp2"):
        history = dist.result(folder / f"{resumed}.json")["history"]
        assert [h["step"] for h in history] == [3, 4]
        dist.assert_steps_match(one[2:], history, ("loss", "grad_norm", "lr"))

    # The TP=2 checkpoint resumes in one process too (DCP reshards the 2-D DTensors on load).
    (tp2 / "ckpt" / "latest").write_text("global_step_2")
    resumed_1 = run_sft(
        train_sft.parse_run(resume_flags(tiny_qwen2, folder / "sft.jsonl", tp2, folder / "to_one"))
    )
    dist.assert_steps_match(one[2:], resumed_1, ("loss", "grad_norm", "lr"))


def test_tp2_other_trainers_match_one_process(tp2_runs, dist):
    """DPO and KTO (their frozen reference split with the same plan), KD (a split teacher), a reward model
    (a value head on the split body) and PPO with GAE (a split critic; every rank's engine holds the
    full gathered policy weights after each sync) under TP=2 match one process. (PPO's actor update is
    the same with GRPO's advantages: one TP=2 PPO run covers both.)"""
    folder, one = tp2_runs["trainers"]
    assert any(h["policy/loss"] != 0.0 for h in one["ppo"])
    for kind, history in one.items():
        two = dist.result(folder / f"{kind}2.json")
        assert len(two["history"]) == len(history) >= 2, kind
        # After an Adam step the sharded matmuls' rounding differences are amplified in the parameters
        # whose gradients are near zero (seen: 6e-5 relative on the reward model's grad norm), within
        # the reorder tolerance.
        dist.assert_steps_match(history, two["history"], KEYS[kind])
    assert dist.result(folder / "ppo2.json")["syncs"] == [[], []]


def test_tp2_plan_styles_of_each_family_match_one(tp2_runs, dist):
    folder, one = tp2_runs["families"]
    for family in FAMILIES:
        two = dist.result(folder / f"{family}2.json")["history"]
        assert len(two) == 2, family
        dist.assert_steps_match(one[family], two, ("loss", "grad_norm"))


def test_tp2_by_dp2_four_processes_match_one(tiny_qwen2, tmp_path, dist):
    """A (dp=2, tp=2) mesh: each data-parallel pair of ranks trains on its half of every batch."""
    sft = AdditionTask(digits=2, seed=4).write_jsonl(tmp_path / "sft.jsonl", 16)
    flags = sft_flags(tiny_qwen2, sft, tmp_path / "one", "--save_steps", "-1", "--max_epochs", "1")
    one = run_sft(train_sft.parse_run(flags))
    argv = sft_flags(tiny_qwen2, sft, tmp_path / "four", "--save_steps", "-1", "--max_epochs", "1", *TP2)
    dist.torchrun(
        [{"kind": "sft", "out": str(tmp_path / "four.json"), "argv": argv}], tmp_path, nproc=4, fork=True
    )
    four = dist.result(tmp_path / "four.json")["history"]
    assert len(four) == len(one) == 2
    dist.assert_steps_match(one, four, ("loss", "grad_norm", "tokens"))


def test_plan_covers_every_decoder_linear(tiny_llama):
    """The plan names every q/k/v/o and gate/up/down projection of the model (a renamed module would
    silently stay replicated)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    split = {name for pattern in tp_plan(model.config) for name, _ in matching_modules(model, pattern)}
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    assert split == linears and len(split) == 7 * model.config.num_hidden_layers


def test_impossible_layouts_fail_before_loading(tiny_qwen2, tmp_path):
    heads = tiny_config("qwen2", num_attention_heads=6, num_key_value_heads=3, intermediate_size=510)
    assert layout_problems(4, 8, heads, model="--pretrain m") == [
        "--ds_tensor_parallel_size 4 must divide num_attention_heads of --pretrain m = 6",
        "--ds_tensor_parallel_size 4 must divide num_key_value_heads of --pretrain m = 3",
        "--ds_tensor_parallel_size 4 must divide intermediate_size of --pretrain m = 510",
    ]
    assert "mixture-of-experts" in layout_problems(2, 2, tiny_config("qwen3_moe"))[0]
    assert layout_problems(2, 2, tiny_config("qwen2")) == []

    sft = AdditionTask(digits=2, seed=4).write_jsonl(tmp_path / "sft.jsonl", 16)
    cases = [
        ([], World(rank=0, world_size=3),
         r"--ds_tensor_parallel_size 2 must divide the number of processes \(3\)"),
        (["--lora_rank", "4"], World(rank=0, world_size=2), "--lora_rank 4: LoRA is not tensor-parallel"),
        (["--train_batch_size", "6", "--micro_train_batch_size", "2"], World(rank=0, world_size=4),
         "--train_batch_size 6"),  # 2 data-parallel groups x 2 x 2 do not make 6
    ]  # fmt: skip
    for extra, world, message in cases:
        run = train_sft.parse_run(sft_flags(tiny_qwen2, sft, tmp_path / "x", *TP2, *extra))
        with pytest.raises(ConfigError, match=message):
            run_sft(run, world)
    with pytest.raises(ConfigError, match="--ring_attn_size 2 with --ds_tensor_parallel_size 2"):
        train_sft.parse_run(sft_flags(tiny_qwen2, sft, tmp_path / "x", *TP2, "--ring_attn_size", "2"))
    moe = build_tiny_model(tmp_path / "moe", "qwen3_moe", seed=0)
    with pytest.raises(ConfigError, match=f"--pretrain {moe} is a mixture-of-experts model"):
        run_sft(train_sft.parse_run(sft_flags(moe, sft, tmp_path / "x", *TP2)), World(rank=0, world_size=2))
    rl = write_rl_data(tmp_path)
    engines = train_ppo.parse_run(grpo_flags(tiny_qwen2, rl, tmp_path / "x", *TP2, "--vllm_num_engines", "2"))
    with pytest.raises(ConfigError, match="--ds_tensor_parallel_size 2 with --vllm_num_engines 2"):
        run_ppo(engines, World(rank=0, world_size=2))
