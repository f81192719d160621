"""MoE in RL: ``--aux_loss_coef`` adds the router load-balancing loss to the policy loss (0 on a dense
model), and GRPO on a tiny Qwen3-MoE learns."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.trainers.experiences import policy_rows
from tests.trainers.test_ppo import write_echo_data
from tidal.config import ModelConfig
from tidal.config.rl import AlgorithmConfig
from tidal.distributed import World
from tidal.experience.experience import Experience, model_batch
from tidal.experience.maker import forward_logprobs
from tidal.models import Precision, load_causal_lm
from tidal.models.forward import model_inputs
from tidal.trainers.ppo.update import Normaliser, PolicyLoss

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from tidal.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe"), "qwen3_moe", seed=0)


def _hand_aux_loss(router_logits: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    """Switch-Transformer load balancing over every token of a packed row: E × Σ_e f_e · P_e, with
    f_e the fraction of (token, slot) picks of expert e and P_e its mean router probability."""
    probs = torch.cat(router_logits).float().softmax(-1)  # [layers × tokens, E]
    n_experts = probs.shape[-1]
    picked = F.one_hot(probs.topk(top_k, dim=-1).indices, n_experts).float()  # [.., k, E]
    return (picked.mean(0) * probs.mean(0)[None]).sum() * n_experts


def _loss_and_metrics(model, exp, coef: float, packing: bool):
    loss_fn = PolicyLoss(AlgorithmConfig(), Precision.create("fp32", CPU), 1.0, packing, aux_loss_coef=coef)
    return loss_fn(model, exp, Normaliser.of(exp, World()))


@pytest.mark.parametrize("packing", [True, False])
def test_aux_loss_coef_adds_router_load_balancing_loss(tiny_moe, packing):
    model = load_causal_lm(ModelConfig(pretrain=str(tiny_moe)), CPU)
    exp = policy_rows(4, 10, seed=0, lengths=[10, 7, 10, 5])
    exp.old_logprobs = forward_logprobs(model, exp, 8, packing, 1.0, Precision.create("fp32", CPU)) - 0.05
    model.eval()  # no dropout: both forwards see the same function
    base, metrics0 = _loss_and_metrics(model, exp, 0.0, packing)
    coef = 0.3
    with_aux, metrics = _loss_and_metrics(model, exp, coef, packing)
    with torch.no_grad():
        if packing:  # every token of the packed row is real: the plain formula, by hand
            inputs = model_inputs(model, model_batch(exp, True))
            router = model.model(**inputs, output_router_logits=True).router_logits
            aux = _hand_aux_loss(router, model.config.num_experts_per_tok)
        else:  # padded rows: HF's own aux loss, which drops padding by the 2-D attention mask
            inputs = model_inputs(model, model_batch(exp, False))
            aux = model(**inputs, output_router_logits=True).aux_loss
    assert aux > 0
    assert "policy/aux_loss" not in metrics0  # runs without the flag log what they always did
    torch.testing.assert_close(float(metrics["policy/aux_loss"]), float(aux), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        float(with_aux.detach()), float(base) + coef * float(aux), rtol=1e-5, atol=1e-6
    )
    # The aux term reaches the router weights through the gradient.
    with_aux.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().max() > 0


def test_aux_loss_coef_is_zero_on_a_dense_model(tiny_llama):
    model = load_causal_lm(ModelConfig(pretrain=str(tiny_llama)), CPU)
    exp = policy_rows(4, 10, seed=0, lengths=[10, 7, 10, 5])
    exp.old_logprobs = forward_logprobs(model, exp, 8, False, 1.0, Precision.create("fp32", CPU))
    model.eval()
    base, _ = _loss_and_metrics(model, exp, 0.0, packing=False)
    with_aux, metrics = _loss_and_metrics(model, exp, 0.5, packing=False)
    assert float(metrics["policy/aux_loss"]) == 0.0
    assert float(with_aux) == float(base)


def test_grpo_on_a_tiny_moe_raises_reward(tiny_moe, tmp_path):
    """The echo task of ``test_ppo``: SFT to a half-right start, then GRPO (with the aux loss on)."""
    from tests.trainers.test_ppo import assert_learns, rl_flags
    from tidal.cli.train_ppo import parse_run
    from tidal.cli.train_sft import parse_run as parse_sft
    from tidal.trainers.ppo import run_ppo
    from tidal.trainers.sft import run_sft

    data = write_echo_data(tmp_path / "data")
    policy = tmp_path / "sft"
    run_sft(parse_sft([
        "--pretrain", str(tiny_moe), "--dataset", str(data / "sft.jsonl"), "--input_key", "prompt",
        "--output_key", "answer", "--max_len", "16", "--train_batch_size", "32", "--micro_train_batch_size", "32",
        "--packing_samples", "--max_epochs", "2", "--learning_rate", "3e-3", "--save_path", str(policy),
        "--input_template", "{}",  # RL prompts are raw: SFT on them untemplated
    ]))  # fmt: skip
    flags = rl_flags(
        policy, data, tmp_path / "rl", "--advantage_estimator", "group_norm", "--aux_loss_coef", "0.001"
    )
    history = run_ppo(parse_run(flags))
    assert len(history) == 10
    assert all("policy/aux_loss" in h and h["policy/aux_loss"] > 0 for h in history)
    assert_learns(history, gain=0.1)  # 0.48 → 0.64 (seeded)


def _engine_vs_trainer_gap(engine_path, trainer, replay: bool) -> float:
    """Mean |engine log-prob − trainer log-prob| over the sampled tokens of a few rollouts."""
    from tidal.models.forward import token_logprobs
    from tidal.models.moe_routing import replayed_routing
    from tidal.rollout import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(
        str(engine_path), config=EngineConfig(device="cpu", dtype="float32", record_routing=True)
    )
    params = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=0, ignore_eos=True)
    gaps = []
    for request in engine.generate([[5, 6, 7, 8, 9], list(range(10, 30))], params):
        for sample in request.outputs:
            tokens = request.prompt_token_ids + sample.token_ids
            ids = torch.from_numpy(sample.routed_experts).long()
            forced = torch.cat([ids, ids.new_full((1, *ids.shape[1:]), -1)])  # the last token: unrecorded
            batch = {"input_ids": torch.tensor([tokens]), "attention_mask": torch.ones(1, len(tokens)),
                     "position_ids": torch.arange(len(tokens))[None]}  # fmt: skip
            with torch.no_grad(), replayed_routing(trainer, forced if replay else None):
                logp = token_logprobs(trainer, batch)[0][0, -len(sample.token_ids) :]
            gaps.append((logp - torch.tensor(sample.logprobs)).abs())
    return float(torch.cat(gaps).mean())


def test_router_replay_brings_trainer_log_probs_to_the_engine(tiny_moe):
    """The trainer's routers differ slightly from the engine's (standing in for bf16 kernels or a
    different reduction order): without replay some tokens go to other experts and their log-probs
    move; with the engine's experts replayed only the routing weights differ, and the gap shrinks."""
    trainer = load_causal_lm(ModelConfig(pretrain=str(tiny_moe)), CPU).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for layer in trainer.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.weight.add_(torch.randn_like(gate.weight) * gate.weight.std() * 0.3)
    without = _engine_vs_trainer_gap(tiny_moe, trainer, replay=False)
    with_replay = _engine_vs_trainer_gap(tiny_moe, trainer, replay=True)
    print(f"engine-vs-trainer |Δ log-prob|: {without:.5f} without replay, {with_replay:.5f} with")
    assert with_replay < 0.5 * without


def test_routed_experts_travel_with_the_experience():
    """Trajectories → Experience (-1 past the recorded tokens), then select/concat/flatten keep them aligned."""
    from types import SimpleNamespace

    from tidal.experience.experience import forced_experts
    from tidal.experience.maker import from_trajectories

    def traj(n, seed):
        routed = torch.randint(0, 8, (n - 1, 3, 2), generator=torch.Generator().manual_seed(seed)).numpy()
        return SimpleNamespace(token_ids=list(range(1, n + 1)), action_mask=[0, 0] + [1] * (n - 2),
                               rollout_logprobs=[0.0] * n, reward=1.0, score=None, routed_experts=routed)  # fmt: skip

    trajectories = [traj(5, 0), traj(7, 1)]
    exp = from_trajectories(trajectories, pad_id=0)
    assert exp.routed_experts.shape == (2, 7, 3, 2)
    assert torch.equal(
        exp.routed_experts[0, :4].long(), torch.from_numpy(trajectories[0].routed_experts).long()
    )
    assert (exp.routed_experts[0, 4:] == -1).all() and (exp.routed_experts[1, 6] == -1).all()
    short = exp.select([0])
    assert short.routed_experts.shape == (1, 5, 3, 2)
    both = Experience.concat([short, exp.select([1])])
    assert torch.equal(both.routed_experts, exp.routed_experts)
    packed = forced_experts(exp, packing=True)  # the real tokens of both rows, in order
    assert packed.shape == (12, 3, 2) and torch.equal(packed[5:], exp.routed_experts[1])
    assert forced_experts(exp, packing=False).shape == (14, 3, 2)


def test_grpo_with_router_replay_routes_the_trainer_as_the_engine(tiny_moe, tmp_path, monkeypatch):
    """End to end: the engine records, the experience carries the experts, and the trainer's old-log-prob
    and update forwards force them (``force_routing`` receives the recorded ids)."""
    from tests.trainers.test_ppo import rl_flags
    from tidal.cli.train_ppo import parse_run
    from tidal.models import moe_routing
    from tidal.trainers.ppo import run_ppo, update

    data = write_echo_data(tmp_path / "data")
    forced = {"scoring": [], "update": []}

    original = moe_routing.force_routing
    monkeypatch.setattr(moe_routing, "force_routing", _spy(original, forced["scoring"]))
    monkeypatch.setattr(update, "force_routing", _spy(original, forced["update"]))
    # Two optimizer steps per rollout, so the old log-probs need their own pass (see
    # ``old_logprobs_from_update``).
    flags = rl_flags(tiny_moe, data, tmp_path / "rl", "--advantage_estimator", "group_norm",
                     "--moe_router_replay", "--max_samples", "32", "--train_batch_size", "64")  # fmt: skip
    history = run_ppo(parse_run(flags))
    assert len(history) == 2
    # Two micro-batches of 64 samples per RL step, for the old log-probs and for the update.
    assert len(forced["scoring"]) == 4 and len(forced["update"]) == 4
    for experts in forced["scoring"] + forced["update"]:
        assert experts.dtype == torch.int16 and experts.shape[1:] == (3, 2) and (experts >= 0).any()


def _spy(fn, calls: list):
    def spied(model, experts):
        if experts is not None:
            calls.append(experts)
        return fn(model, experts)

    return spied


def test_router_replay_is_refused_on_a_dense_model(tiny_llama, tmp_path):
    from tests.trainers.test_ppo import rl_flags
    from tidal.cli.train_ppo import parse_run
    from tidal.config import ConfigError
    from tidal.trainers.ppo import run_ppo

    data = write_echo_data(tmp_path / "data")
    flags = rl_flags(tiny_llama, data, tmp_path / "rl", "--moe_router_replay")
    with pytest.raises(ConfigError, match="--moe_router_replay: .* dense model"):
        run_ppo(parse_run(flags))


def _perturbed_routers(model):
    """The trainer's routers moved by 0.3 × their std: a stand-in for kernels that flip routing."""
    torch.manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.weight.add_(torch.randn_like(gate.weight) * gate.weight.std() * 0.3)
    return model


def test_grpo_with_a_multi_turn_agent_replays_every_turn(tiny_moe, tmp_path, monkeypatch):
    """``--agent_func_path`` with ``--moe_router_replay``: the experience carries the engine's experts on
    prompt, action and feedback tokens, and the first step's old log-probs (trainer routers perturbed, the
    engine's not) are much closer to the engine's with replay than without (the same rollout: same seed)."""
    from tests.trainers.test_ppo import EXAMPLES, rl_flags
    from tidal.cli.train_ppo import parse_run
    from tidal.trainers.ppo import entry, run_ppo
    from tidal.trainers.ppo import trainer as trainer_module

    data = write_echo_data(tmp_path / "data")
    monkeypatch.setattr(entry, "load_causal_lm", lambda *a, **k: _perturbed_routers(load_causal_lm(*a, **k)))
    seen = []
    original = trainer_module.PPOTrainer.make_experience

    def spy(self, exp):
        seen.append(exp)
        return original(self, exp)

    monkeypatch.setattr(trainer_module.PPOTrainer, "make_experience", spy)
    mismatch = {}
    for replay in (False, True):
        flags = rl_flags(tiny_moe, data, tmp_path / f"rl{replay}", "--advantage_estimator", "group_norm",
                         "--agent_func_path", str(EXAMPLES / "agent_func.py"), "--rollout_batch_size", "4",
                         "--train_batch_size", "32", "--micro_train_batch_size", "32",
                         "--micro_rollout_batch_size", "32", "--max_samples", "4", "--prompt_max_len", "48",
                         *(["--moe_router_replay"] if replay else []))  # fmt: skip
        flags.remove("--remote_rm_url")
        flags.remove(str(EXAMPLES / "reward_func.py"))
        [step] = run_ppo(parse_run(flags))
        mismatch[replay] = step["rollout/logprob_mismatch"]
    print(
        f"multi-turn engine-vs-trainer |Δ log-prob|: {mismatch[False]:.5f} without replay, {mismatch[True]:.5f} with"
    )
    assert mismatch[True] < 0.5 * mismatch[False]
    exp = seen[-1]
    assert seen[0].routed_experts is None and exp.routed_experts.shape[2:] == (3, 2)
    # Feedback between two actions: its tokens carry the experts of the prefill that read them.
    acted, real = exp.action_mask.bool(), exp.attention_mask.bool()
    feedback = ~acted & real & (acted.long().cumsum(1) > 0) & (acted.long().flip(1).cumsum(1).flip(1) > 0)
    assert feedback.any(), "expected environment feedback between two actions"
    assert (exp.routed_experts[feedback] >= 0).all() and (exp.routed_experts[acted] >= 0).any()


@pytest.mark.parametrize("agent_flag", ["--agent_func_path", "--agent_endpoint"])
def test_router_replay_is_accepted_with_agents(tiny_moe, tmp_path, agent_flag):
    """Both agent kinds carry the engine's experts into their trajectories (tests/agents/test_router_replay.py)."""
    from tests.trainers.test_ppo import EXAMPLES, rl_flags
    from tidal.cli.train_ppo import parse_run
    from tidal.trainers.ppo.entry import check_models_before_loading

    agent = tmp_path / "agent.py"
    agent.write_text("def agent(base_url, prompt, label):\n    return 0.0\n")
    flags = rl_flags(tiny_moe, write_echo_data(tmp_path / "data"), tmp_path / "rl", "--moe_router_replay",
                     agent_flag, str(agent))  # fmt: skip
    flags.remove("--remote_rm_url")
    flags.remove(str(EXAMPLES / "reward_func.py"))
    check_models_before_loading(parse_run(flags))


def test_replayed_update_gradients_survive_gradient_checkpointing(tiny_moe):
    """The forced experts stay set through backward, so a checkpointing recompute routes as the forward
    did: the gradients equal those without checkpointing (and differ from unreplayed routing)."""
    from tidal.models.moe_routing import force_routing

    exp = policy_rows(4, 10, seed=0, lengths=[10, 7, 10, 5])
    g = torch.Generator().manual_seed(3)
    exp.routed_experts = torch.randint(0, 8, (*exp.sequences.shape, 3, 2), generator=g).to(torch.int16)
    exp.routed_experts[..., 1] = (exp.routed_experts[..., 0] + 1) % 8  # two distinct experts per token
    precision = Precision.create("fp32", CPU)
    grads = {}
    for checkpointing, replay in [(False, True), (True, True), (False, False)]:
        model = load_causal_lm(ModelConfig(pretrain=str(tiny_moe)), CPU)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        exp.old_logprobs = torch.zeros_like(exp.rollout_logprobs)
        loss_fn = PolicyLoss(AlgorithmConfig(), precision, 1.0, False, router_replay=replay)
        loss, _ = loss_fn(model, exp, Normaliser.of(exp, World()))
        loss.backward()
        force_routing(model, None)
        grads[(checkpointing, replay)] = model.model.layers[0].mlp.experts.down_proj.grad.clone()
    torch.testing.assert_close(grads[(True, True)], grads[(False, True)], atol=1e-6, rtol=1e-5)
    assert not torch.allclose(grads[(False, True)], grads[(False, False)], atol=1e-6)
