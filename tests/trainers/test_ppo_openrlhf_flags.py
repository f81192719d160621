"""OpenRLHF v0.9.2's PPO flags that tidal honours as v0.9.2 does: ``--no_advantage_std_norm`` (centre,
do not scale), ``--stop_properly_penalty_coef`` (truncated samples' rewards scaled), ``--enable_ema``
/ ``--ema_beta`` (an EMA of the policy, saved at the end) and ``--ptx_coef`` with ``--pretrain_data``
(a next-token loss on pretraining text mixed into the policy update). Hand-computed where it is math."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.trainers.experiences import policy_rows, reward_rows
from tidal.algorithms.advantages import masked_centre
from tidal.algorithms.rewards import stop_properly_penalty
from tidal.cli.train_ppo import parse_run
from tidal.config import ModelConfig
from tidal.config.args import ConfigError
from tidal.config.rl import AlgorithmConfig
from tidal.data import SFTSample
from tidal.distributed import World
from tidal.experience.experience import Experience
from tidal.experience.maker import add_advantages, forward_logprobs, from_trajectories, shape_rewards
from tidal.models import Precision, load_causal_lm
from tidal.trainers.ppo import run_ppo
from tidal.trainers.ppo import trainer as trainer_module
from tidal.trainers.ppo import update as update_module
from tidal.trainers.ppo.ema import PolicyEMA
from tidal.trainers.ppo.ptx import PtxLoss, PtxStream
from tidal.trainers.ppo.update import Normaliser, PolicyLoss
from tidal.trainers.sft import SFTObjective

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


# ---- --no_advantage_std_norm ---------------------------------------------------------------------
def test_masked_centre_subtracts_the_masked_mean_only():
    x = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # mean of 1, 2, 3 = 2; masked entries become 0
    assert_close(masked_centre(x, mask), torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))


def test_no_advantage_std_norm_centres_reinforce_advantages():
    """REINFORCE (γ=1): both action tokens of a row carry its reward R; the batch mean of R over the
    action tokens is 0.5, so the advantages are R − 0.5 — not divided by the std (2.06)."""
    rewards = torch.tensor([0.0, 1.0, 3.0, -2.0])
    cfg = AlgorithmConfig(advantage_estimator="reinforce", no_advantage_std_norm=True)
    exp = add_advantages(reward_rows(rewards), cfg, 1, kl_coef=0.0)
    expected = torch.tensor([-0.5, 0.5, 2.5, -2.5])[:, None] * torch.tensor([[0.0, 1.0, 1.0]])
    assert_close(exp.advantages, expected)
    whitened = add_advantages(reward_rows(rewards), AlgorithmConfig(advantage_estimator="reinforce"), 1, 0.0)
    assert_close(whitened.advantages, expected / expected[:, 1:].std(unbiased=False), atol=1e-5, rtol=1e-5)


def test_no_advantage_std_norm_is_refused_where_nothing_is_normalised():
    with pytest.raises(ConfigError, match="--no_advantage_std_norm: --advantage_estimator group_norm"):
        AlgorithmConfig(advantage_estimator="group_norm", no_advantage_std_norm=True)
    assert AlgorithmConfig(advantage_estimator="gae", no_advantage_std_norm=True).problems() == []


# ---- --stop_properly_penalty_coef ----------------------------------------------------------------
def test_stop_properly_penalty_scales_truncated_rewards():
    rewards = torch.tensor([1.0, -2.0, 3.0, 0.5])
    truncated = torch.tensor([True, True, False, False])
    assert_close(stop_properly_penalty(rewards, truncated, 0.5), torch.tensor([0.5, -1.0, 3.0, 0.5]))
    assert_close(stop_properly_penalty(rewards, truncated, 0.0), torch.tensor([0.0, 0.0, 3.0, 0.5]))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        stop_properly_penalty(rewards, truncated, 1.5)


def test_stop_properly_penalty_comes_after_the_overlong_penalty():
    """v0.9.2's order: reward 3, overlong penalty −1 (2 action tokens of at most 2, buffer 1) → 2,
    then truncated × 0.5 → 1 (the other order would give 0.5). An untruncated sample keeps 3 − 1."""
    cfg = AlgorithmConfig(overlong_buffer_len=1, stop_properly_penalty_coef=0.5)
    exp = reward_rows(torch.tensor([3.0, 3.0]), truncated=torch.tensor([True, False]))
    assert_close(shape_rewards(exp, cfg, max_new_tokens=2, moments=None), torch.tensor([1.0, 2.0]))
    off = AlgorithmConfig(overlong_buffer_len=1)
    assert_close(shape_rewards(exp, off, max_new_tokens=2, moments=None), torch.tensor([2.0, 2.0]))


def test_trajectories_record_which_samples_were_cut_at_the_limit():
    def traj(reason):
        return SimpleNamespace(token_ids=[1, 2, 3], action_mask=[0, 1, 1], rollout_logprobs=[0.0] * 3,
                               reward=1.0, score=None, finish_reason=reason)  # fmt: skip

    exp = from_trajectories([traj("length"), traj("stop"), traj("done")], pad_id=0)
    assert exp.truncated.tolist() == [True, False, False]
    assert exp.select([0, 2]).truncated.tolist() == [True, False]
    assert Experience.concat([exp, exp]).truncated.tolist() == [True, False, False] * 2


# ---- flags → configs -----------------------------------------------------------------------------
def _ppo_flags(*extra):
    return ["--pretrain", "m", "--prompt_data", "d", *extra]


def test_flags_parse_into_the_algorithm_config():
    run = parse_run(_ppo_flags("--no_advantage_std_norm", "--stop_properly_penalty_coef", "0.3"))
    assert run.algorithm.no_advantage_std_norm and run.algorithm.stop_properly_penalty_coef == 0.3
    default = parse_run(_ppo_flags())
    assert (
        not default.algorithm.no_advantage_std_norm and default.algorithm.stop_properly_penalty_coef is None
    )


def test_stop_properly_penalty_coef_outside_unit_interval_is_refused():
    with pytest.raises(ConfigError, match=r"--stop_properly_penalty_coef must be in \[0, 1\], got 2"):
        parse_run(_ppo_flags("--stop_properly_penalty_coef", "2"))


# ---- --enable_ema / --ema_beta -------------------------------------------------------------------
def _linear(weight) -> torch.nn.Linear:
    layer = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([weight]))
    return layer


def test_ema_after_k_steps_is_the_closed_form():
    """β = 0.5, weights w0 = [4, 8], then w1 = [0, 0], w2 = [2, 2]:
    ema_2 = β²·w0 + (1−β)·β·w1 + (1−β)·w2 = [1, 2] + 0 + [1, 1] = [2, 3]."""
    layer = _linear([4.0, 8.0])
    ema = PolicyEMA(layer, 0.5)
    for w in ([0.0, 0.0], [2.0, 2.0]):
        with torch.no_grad():
            layer.weight.copy_(torch.tensor([w]))
        ema.update()
    assert_close(ema.average[0], torch.tensor([[2.0, 3.0]]))
    with ema.swapped_in():  # what is saved
        assert_close(layer.weight.detach(), torch.tensor([[2.0, 3.0]]))
    assert_close(layer.weight.detach(), torch.tensor([[2.0, 2.0]]))  # training continues from its own


def test_ema_state_round_trips_and_an_empty_state_restarts_from_the_weights():
    layer = _linear([4.0, 8.0])
    ema = PolicyEMA(layer, 0.9)
    ema.average[0].fill_(7.0)
    other = PolicyEMA(_linear([0.0, 0.0]), 0.9)
    other.load_state_dict(ema.state_dict())
    assert_close(other.average[0], torch.full((1, 2), 7.0))
    ema.load_state_dict({})  # a checkpoint written without --enable_ema
    assert_close(ema.average[0], torch.tensor([[4.0, 8.0]]))
    with pytest.raises(ConfigError, match="--enable_ema"):
        PolicyEMA(torch.nn.Linear(3, 1, bias=False), 0.9).load_state_dict(ema.state_dict())


def test_ema_averages_only_trained_weights():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model[0].requires_grad_(False)  # a LoRA's frozen base, say
    assert [tuple(a.shape) for a in PolicyEMA(model, 0.9).average] == [(1, 2), (1,)]


def _rl_flags(policy, data: Path, out: Path, *extra):
    return [
        "--pretrain", str(policy), "--prompt_data", str(data / "prompts.jsonl"), "--input_key", "prompt",
        "--label_key", "label", "--remote_rm_url", str(EXAMPLES / "reward_func.py"), "--n_samples_per_prompt", "8",
        "--rollout_batch_size", "16", "--train_batch_size", "128", "--micro_train_batch_size", "64",
        "--micro_rollout_batch_size", "64", "--generate_max_len", "4", "--prompt_max_len", "8",
        "--actor_learning_rate", "1e-3", "--lr_warmup_ratio", "0", "--init_kl_coef", "0",
        "--advantage_estimator", "group_norm", "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"),
        "--seed", "3", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def rl_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("ptx")
    with (d / "prompts.jsonl").open("w") as f:
        for i in range(64):
            f.write(json.dumps({"prompt": f"{i % 10}>", "label": str(i % 10)}) + "\n")
    with (d / "pretrain.jsonl").open("w") as f:  # distinct short texts: which ones a step reads matters
        for i in range(200):
            f.write(json.dumps({"prompt": f"{i} fox"}) + "\n")
    return d


def _weights(folder) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32)
    return {k: v.detach() for k, v in model.named_parameters()}


def test_saved_model_is_the_ema_of_the_policy_after_each_step(tiny_qwen2, rl_data, tmp_path, monkeypatch):
    """Two optimizer steps with β = 0.5: the saved model is β²·w0 + (1−β)·β·w1 + (1−β)·w2 of the
    policy's weights w_i after each step, recorded as the run goes."""
    seen: list[dict[str, torch.Tensor]] = []
    original = update_module.optimizer_step

    def recording(opt):
        if not seen:
            seen.append({k: v.detach().clone() for k, v in opt.model.named_parameters()})
        norm = original(opt)
        seen.append({k: v.detach().clone() for k, v in opt.model.named_parameters()})
        return norm

    monkeypatch.setattr(update_module, "optimizer_step", recording)
    flags = _rl_flags(
        tiny_qwen2, rl_data, tmp_path, "--max_samples", "32", "--enable_ema", "--ema_beta", "0.5"
    )
    assert len(run_ppo(parse_run(flags))) == 2 and len(seen) == 3
    beta, saved = 0.5, _weights(tmp_path / "final")
    for name, w0 in seen[0].items():
        expected = beta**2 * w0 + (1 - beta) * beta * seen[1][name] + (1 - beta) * seen[2][name]
        assert_close(saved[name], expected, atol=1e-6, rtol=1e-5, msg=name)
    assert any(not torch.equal(saved[k], seen[2][k]) for k in saved)  # not the last policy


def test_resume_is_exact_with_ema_and_ptx(tiny_qwen2, rl_data, tmp_path, crash_after):
    """The EMA weights and the ptx stream's position are in the checkpoint: a run cut during step 3
    and resumed from step 2 logs the same ptx loss and saves the same (EMA) model."""
    common = ["--max_samples", "48", "--save_steps", "2", "--enable_ema", "--ema_beta", "0.5",
              "--pretrain_data", str(rl_data / "pretrain.jsonl"), "--ptx_coef", "0.5"]  # fmt: skip
    full = run_ppo(parse_run(_rl_flags(tiny_qwen2, rl_data, tmp_path / "full", *common)))
    assert len(full) == 3
    restore = crash_after(trainer_module.PPOTrainer, "update", 2)
    with pytest.raises(KeyboardInterrupt):
        run_ppo(parse_run(_rl_flags(tiny_qwen2, rl_data, tmp_path / "cut", *common)))
    restore()
    resumed = run_ppo(
        parse_run(_rl_flags(tiny_qwen2, rl_data, tmp_path / "cut", *common, "--load_checkpoint"))
    )
    assert [h["step"] for h in resumed] == [3]
    for a, b in zip(full[2:], resumed, strict=True):
        assert a["policy/ptx_loss"] == pytest.approx(b["policy/ptx_loss"], abs=1e-6)
    full_w, resumed_w = _weights(tmp_path / "full" / "final"), _weights(tmp_path / "cut" / "final")
    for name, w in full_w.items():
        assert_close(resumed_w[name], w, atol=1e-6, rtol=1e-5, msg=name)


# ---- --ptx_coef with --pretrain_data -------------------------------------------------------------
def test_ptx_stream_gives_ranks_disjoint_micro_batches_and_resumes():
    samples = [SFTSample([i, i], [0, 1]) for i in range(6)]
    ranks = [PtxStream(samples, 2, seed=1, rank=r, world_size=2) for r in range(2)]
    first_pass = [s.input_ids[0] for _ in range(3 // 2 + 1) for r in ranks for s in r.next()][:6]
    assert sorted(first_pass) == list(range(6))  # one shuffled pass over the samples, split between ranks
    a = PtxStream(samples, 2, seed=1)
    a.next()
    b = PtxStream(samples, 2, seed=1)
    b.load_state_dict(a.state_dict())
    assert [s.row for s in a.next()] == [s.row for s in b.next()] and a.position == b.position == 2


def _nll(model, ids: list[int]) -> torch.Tensor:
    """Mean −log p of tokens 1.. of ``ids`` (every token trained, as pretrain mode)."""
    logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum")


def test_policy_update_gradient_is_policy_loss_plus_coef_times_ptx_loss(tiny_llama):
    """Two micro-batches, each followed by a ptx micro-batch: the accumulated gradient equals the
    gradient of (policy loss of the step) + coef · (mean over the two ptx micro-batches of their
    token-mean NLL), the NLL computed by hand sample by sample."""
    model = load_causal_lm(ModelConfig(pretrain=str(tiny_llama)), torch.device("cpu"))
    precision = Precision.create("fp32", torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    samples = [
        SFTSample(torch.randint(5, 500, (n,), generator=g).tolist(), [0] + [1] * (n - 1))
        for n in (5, 7, 4, 6)
    ]
    exp = policy_rows(6, 10, seed=1)
    exp.old_logprobs = forward_logprobs(model, exp, 8, False, 1.0, precision) - 0.05
    policy = PolicyLoss(AlgorithmConfig(), precision, 1.0, False)
    norm, coef, halves = Normaliser.of(exp, World()), 0.3, ([0, 1, 2], [3, 4, 5])

    model.zero_grad()
    ptx = PtxLoss(coef, PtxStream(samples, 2, seed=5), SFTObjective(0), precision, torch.device("cpu"))
    for rows in halves:
        loss, _ = policy(model, exp.select(rows), norm)
        loss.backward()
        extra, metrics = ptx(model, len(halves))
        extra.backward()
    mixed = torch.cat([p.grad.flatten() for p in model.parameters()])

    model.zero_grad()
    stream = PtxStream(samples, 2, seed=5)
    total = sum(policy(model, exp.select(rows), norm)[0] for rows in halves)
    for _ in halves:
        batch = stream.next()
        nll = sum(_nll(model, s.input_ids) for s in batch) / sum(len(s) - 1 for s in batch)
        total = total + coef * nll / len(halves)
    total.backward()
    by_hand = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert metrics["policy/ptx_loss"] > 0
    assert_close(mixed, by_hand, atol=1e-6, rtol=1e-4)


def test_a_tiny_run_with_ptx_learns_the_pretrain_text(tiny_qwen2, rl_data, tmp_path):
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"prompt": "fox dog"}) + "\n")
    flags = _rl_flags(tiny_qwen2, rl_data, tmp_path, "--max_samples", "48", "--pretrain_data", str(text),
                      "--ptx_coef", "1")  # fmt: skip
    history = run_ppo(parse_run(flags))
    ptx = [h["policy/ptx_loss"] for h in history]
    assert ptx[-1] < ptx[0] - 1.0, ptx
    ids = AutoTokenizer.from_pretrained(str(tiny_qwen2))("fox dog")["input_ids"]
    before = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2), torch_dtype=torch.float32)
    after = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"), torch_dtype=torch.float32)
    with torch.no_grad():
        assert _nll(after, ids) < _nll(before, ids) - 1.0


def test_pretrain_data_without_ptx_coef_is_refused():
    with pytest.raises(ConfigError, match="--pretrain_data is only read for the ptx loss"):
        parse_run(_ppo_flags("--pretrain_data", "p.jsonl", "--ptx_coef", "0"))
    run = parse_run(_ppo_flags("--enable_ema", "--pretrain_data", "p.jsonl"))
    assert (run.ema.enable, run.ema.beta, run.ptx.coef, run.ptx.data) == (True, 0.992, 0.05, "p.jsonl")


def test_the_trainer_scales_the_rewards_of_truncated_samples(tiny_qwen2, rl_data, tmp_path, monkeypatch):
    """A constant reward of 1 through a real step: with coef 0.25 the samples cut at --generate_max_len
    reach the advantages with 0.25, the others with 1."""
    (tmp_path / "ones.py").write_text(
        "import torch\n\ndef reward_func(queries, prompts, labels, **kwargs):\n"
        "    return {'rewards': torch.ones(len(queries))}\n"
    )
    seen = []
    original = trainer_module.PPOTrainer.advantages

    def spy(self, exp, stats):
        seen.append((exp.rewards.clone(), exp.truncated.clone()))
        return original(self, exp, stats)

    monkeypatch.setattr(trainer_module.PPOTrainer, "advantages", spy)
    flags = _rl_flags(tiny_qwen2, rl_data, tmp_path, "--max_samples", "16", "--stop_properly_penalty_coef", "0.25",
                      "--remote_rm_url", str(tmp_path / "ones.py"))  # fmt: skip
    run_ppo(parse_run(flags))
    rewards, truncated = seen[0]
    assert truncated.any()
    assert_close(rewards, torch.where(truncated, 0.25, 1.0))


@pytest.mark.parametrize(("family", "reason"), [("gemma2", "soft-capping"), ("phi3", "LongRoPE")])
def test_prefix_caching_refused_before_loading_for_models_it_cannot_serve(family, reason, tmp_path):
    """``--enable_prefix_caching`` on a policy whose prefill cannot read a cached head (Gemma 2's
    soft-capped scores, Phi-3's LongRoPE) fails in one line from the config, before anything loads."""
    from tests.rollout.test_dense_families import LONGROPE
    from tests.trainers.test_ppo import rl_flags, write_echo_data
    from tidal.cli.train_ppo import parse_run
    from tidal.config import ConfigError
    from tidal.testing import build_tiny_model
    from tidal.trainers.ppo.entry import check_models_before_loading

    policy = build_tiny_model(tmp_path / family, family, seed=0, **(LONGROPE if family == "phi3" else {}))
    data = write_echo_data(tmp_path / "data")
    run = parse_run(rl_flags(policy, data, tmp_path / "rl", "--enable_prefix_caching"))
    with pytest.raises(ConfigError, match=f"--enable_prefix_caching: not supported with .*{reason}"):
        check_models_before_loading(run)
