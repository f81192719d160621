"""``--exact_logprobs`` in GRPO runs beyond one process with a local engine: FSDP2 over 2 processes
(gloo), separate engine processes fed by the weight sync, LoRA (merged weights), alone and sharded.
On every rank, at every step, the forward the trainer skipped is run anyway and must give the engine's
log-probs bit for bit (without the mode it does not: checked too, so the check is not vacuous).

This file is also the ranks' script (``python -m torch.distributed.run --nproc_per_node 2
test_exact_rl.py RUNS.json``, or the fork launcher of tests/trainers/conftest.py): it runs each spec of
RUNS.json and writes one JSON report per rank."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

REWARD = '''
import torch


def reward_func(queries, prompts, labels, **kwargs):
    """A dense, deterministic reward of the response text, so every group has a signal."""
    return {"rewards": torch.tensor([sum(ord(c) for c in q[len(p):]) % 7 / 7 for q, p in zip(queries, prompts)])}
'''


def grpo_flags(policy, data: Path, out: Path, *extra: str, steps: int = 2) -> list[str]:
    """``steps`` GRPO steps of 2 prompts x 4 samples (one optimizer step each), packed."""
    return [
        "--pretrain", str(policy), "--prompt_data", str(data / "prompts.jsonl"), "--input_key", "prompt",
        "--label_key", "label", "--remote_rm_url", str(data / "reward.py"), "--advantage_estimator", "group_norm",
        "--n_samples_per_prompt", "4", "--rollout_batch_size", "2", "--train_batch_size", "8",
        "--micro_train_batch_size", "4", "--micro_rollout_batch_size", "4", "--generate_max_len", "6",
        "--prompt_max_len", "8", "--actor_learning_rate", "5e-3", "--lr_warmup_ratio", "0", "--init_kl_coef", "0",
        "--temperature", "0.9", "--seed", "3", "--max_samples", str(2 * steps), "--packing_samples", "--zero_stage", "3",
        "--save_path", str(out / "final"), *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("exact_rl")
    with (d / "prompts.jsonl").open("w") as f:
        for i in range(6):
            f.write(json.dumps({"prompt": f"{i}+{i % 3}=", "label": str(i + i % 3)}) + "\n")
    (d / "reward.py").write_text(REWARD)
    return d


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A tiny Qwen3-MoE model folder (one build for the module's tests)."""
    from tidal.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("moe"), "qwen3_moe", seed=0)


# ---------------------------------------------------------------- the check, run in every process
def lora_b_norm(model) -> float:
    """Sum of |B| over this rank's LoRA B weights (0 before the adapters learn anything)."""
    total = 0.0
    for name, p in model.named_parameters():
        if "lora_B" in name:
            total += float((p.to_local() if hasattr(p, "to_local") else p).detach().abs().sum())
    return total


def run_checked(argv: list[str]) -> dict:
    """Run ``tidal ppo`` with ``argv``; at each step, this rank's max |engine - trainer forward| log-prob
    over the action tokens, their count and the LoRA B norm. In exact mode the trainer's own old-log-prob
    forward must not run (it raises)."""
    from tidal.cli.train_ppo import main as ppo_main
    from tidal.experience.maker import forward_logprobs
    from tidal.trainers.ppo import trainer as trainer_module

    report = {"gaps": [], "tokens": [], "lora_b": []}
    exact = "--exact_logprobs" in argv
    real_forward, real_make = trainer_module.forward_logprobs, trainer_module.PPOTrainer.make_experience

    def no_forward(*args, **kwargs):
        raise AssertionError("--exact_logprobs ran the old-log-prob forward")

    def make_experience(self, exp):
        out, stats = real_make(self, exp)
        micro, packing, _ = self._scoring_shape()
        actor = self.parts.actor
        lp = forward_logprobs(actor.model, out, micro, packing, self.run.rollout.temperature, actor.precision)
        mask = out.action_mask.bool()
        report["gaps"].append(float((lp[mask] - out.rollout_logprobs[mask]).abs().max()))
        report["tokens"].append(int(mask.sum()))
        report["lora_b"].append(lora_b_norm(actor.model))
        return out, stats

    trainer_module.forward_logprobs = no_forward if exact else real_forward
    trainer_module.PPOTrainer.make_experience = make_experience
    try:
        report["history"] = ppo_main(argv)
    finally:
        trainer_module.forward_logprobs, trainer_module.PPOTrainer.make_experience = real_forward, real_make
    return report


def main() -> None:
    """torchrun entry: every spec ``{"argv": [...], "out": prefix}`` in order; ``<prefix><rank>.json``."""
    from tidal.distributed import init_world, shutdown

    torch.set_num_threads(1)
    world = init_world()
    for spec in json.loads(Path(sys.argv[1]).read_text()):
        report = run_checked(spec["argv"])
        Path(f"{spec['out']}{world.rank}.json").write_text(json.dumps(report))
    shutdown(world)


def assert_exact(report: dict, steps: int) -> None:
    assert len(report["history"]) == steps and len(report["gaps"]) == steps
    assert min(report["tokens"]) > 0 and report["gaps"] == [0.0] * steps, report["gaps"]
    assert all(h["rollout/logprob_mismatch"] == 0.0 for h in report["history"])
    assert any(h["grad_norm"] > 0.0 for h in report["history"][:-1])  # later steps ran updated weights


# ---------------------------------------------------------------- tests
LORA = ["--lora_rank", "4", "--lora_alpha", "16", "--target_modules", "all-linear"]


def test_lora_policy_gives_the_engine_logprobs_exactly_and_learns(tiny_qwen2, data, tmp_path):
    """The engine runs the merged weights; the policy's exact forward multiplies by the same tensor."""
    report = run_checked(grpo_flags(tiny_qwen2, data, tmp_path / "lora", "--exact_logprobs", *LORA))
    assert_exact(report, 2)
    assert report["lora_b"][0] == 0.0 and report["lora_b"][-1] > 0.0  # the adapters trained
    assert any(h["policy/loss"] != 0.0 for h in report["history"])
    plain = run_checked(grpo_flags(tiny_qwen2, data, tmp_path / "plain", *LORA))
    assert max(plain["gaps"]) > 0.0  # without the mode the same check sees the gap


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_lora_merge_is_the_forward_weight_and_restores_the_base(tiny_qwen2, dtype):
    """The sync's merge (``engine_weights``) hands the engine exactly the weight the exact forward
    multiplies by (computed in the compute dtype: bf16 as on CUDA), and puts the base weights back bit
    for bit (peft's ``W + d - d`` would not)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tidal.distributed.weight_sync import engine_weights, hf_name
    from tidal.models.exact_lora import make_lora_exact, merged_weight
    from tidal.rollout.batch_invariant import make_exact

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=16, target_modules="all-linear"))
    with torch.no_grad():  # adapters the size of the weights: rounding in W + d shows
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.5)
    make_lora_exact(make_exact(model, compute_dtype=dtype))
    layers = {n: m for n, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")}
    expected = {
        hf_name(f"{n}.base_layer.weight"): merged_weight(m).detach().clone() for n, m in layers.items()
    }
    base = {n: m.base_layer.weight.detach().clone() for n, m in layers.items()}
    with engine_weights(model) as named:
        sent = {n: t.detach().clone() for n, t in named if n in expected}
    assert sent.keys() == expected.keys()
    assert all(torch.equal(sent[n], expected[n].float()) for n in sent)  # float32 holds them exactly
    # FSDP2 with mixed precision all-gathers W, A and B already rounded: the forward's merge is the same
    gathered = {n: m for n, m in copy.deepcopy(model).to(dtype).named_modules() if n in layers}
    assert all(
        torch.equal(merged_weight(m), expected[hf_name(f"{n}.base_layer.weight")])
        for n, m in gathered.items()
    )
    assert all(torch.equal(m.base_layer.weight, base[n]) for n, m in layers.items())
    drift = [
        n
        for n, m in layers.items()
        if not torch.equal(base[n] + (d := m.get_delta_weight("default")) - d, base[n])
    ]
    assert drift  # why the exact merge restores instead of subtracting


def test_lora_bf16_engine_synced_from_a_float32_master_policy_is_exact(tiny_qwen2):
    """The CUDA dtype path on the CPU: trained (random) adapters on a float32 master policy computing in
    bf16 under autocast; the weight sync into a bf16 engine; sampled log-probs == the policy's forward."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tidal.distributed.weight_sync import engine_weights
    from tidal.models.exact_lora import make_lora_exact
    from tidal.models.forward import token_logprobs
    from tidal.models.precision import Precision
    from tidal.rollout import EngineConfig, LLMEngine
    from tidal.rollout.batch_invariant import make_exact
    from tidal.rollout.sampling_params import SamplingParams

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=16, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)
    make_lora_exact(make_exact(model, compute_dtype=torch.bfloat16))
    config = EngineConfig(
        device="cpu", dtype="bfloat16", max_model_len=64, num_kv_blocks=32, exact_logprobs=True
    )
    engine = LLMEngine(str(tiny_qwen2), config)
    with engine_weights(model) as named:
        engine.update_weights(named)
    prompts = [[5 + i, 40 + 3 * i, 90, 7 * i + 11][: 2 + i % 3] for i in range(5)]
    params = [SamplingParams(temperature=0.9, max_tokens=4 + i, seed=i, ignore_eos=True) for i in range(5)]
    outputs = engine.generate(prompts, params)
    rows = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs, strict=True)]
    batch = {
        "input_ids": torch.tensor([t for r in rows for t in r])[None],
        "position_ids": torch.cat([torch.arange(len(r)) for r in rows])[None],
    }
    with torch.no_grad(), Precision.create("bf16", torch.device("cpu")).autocast():
        lp = token_logprobs(model, batch, 0.9)[0][0]
    offset = 0
    for p, r, o in zip(prompts, rows, outputs, strict=True):
        assert torch.equal(lp[offset + len(p) : offset + len(r)], torch.tensor(o.outputs[0].logprobs))
        offset += len(r)


def test_exact_lora_refuses_adapters_without_a_merged_linear_form(tiny_qwen2):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tidal.config import ConfigError
    from tidal.models.exact_lora import make_lora_exact

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]))
    with pytest.raises(ConfigError, match="LoRA on Embedding layers"):
        make_lora_exact(model)


def test_moe_policy_gives_the_engine_logprobs_exactly(moe, data, tmp_path):
    """Qwen3-MoE, with router replay (the engine records its experts through the exact block) and the
    load-balancing loss (hooks on the exact routers): exact at every step."""
    extra = ["--moe_router_replay", "--aux_loss_coef", "0.01"]
    assert_exact(run_checked(grpo_flags(moe, data, tmp_path / "run", "--exact_logprobs", *extra)), 2)


@pytest.mark.slow  # 4 runs of 2 ranks (one launch): about 25 s on a loaded 2-core machine
def test_exact_over_two_processes_and_separate_engines(tiny_qwen2, moe, data, tmp_path, ranks):
    """FSDP2 over 2 gloo processes: one separate engine process per rank (weights by broadcast); LoRA on
    the sharded policy with each rank's own engine (each rank merges its rows); Qwen3-MoE with router
    replay. Every rank is exact. (A dense policy without LoRA on each rank's own engine needs no run of
    its own: "engines" runs its sharded exact forward, "lora" and "moe" the sync of sharded weights into
    a rank's own engine.)"""
    runs = {
        "engines": (tiny_qwen2, ["--exact_logprobs", "--vllm_num_engines", "2"]),
        "lora": (tiny_qwen2, ["--exact_logprobs", *LORA]),
        "moe": (moe, ["--exact_logprobs", "--moe_router_replay"]),
        "plain": (tiny_qwen2, []),
    }
    specs = [
        {"argv": grpo_flags(policy, data, tmp_path / name, *extra), "out": str(tmp_path / name)}
        for name, (policy, extra) in runs.items()
    ]
    (tmp_path / "runs.json").write_text(json.dumps(specs))
    # this file's main() as 2 ranks, forked by tests/trainers/conftest.py's launcher
    ranks.launch(Path(__file__), tmp_path / "runs.json")
    for rank in (0, 1):
        reports = {name: json.loads((tmp_path / f"{name}{rank}.json").read_text()) for name in runs}
        for name in ("engines", "lora", "moe"):
            assert_exact(reports[name], 2)
        assert reports["lora"]["lora_b"][-1] > 0.0
        assert max(reports["plain"]["gaps"]) > 0.0


if __name__ == "__main__":
    main()
