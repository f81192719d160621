"""One GRPO step, top to bottom: sample → reward → group baseline → loss → step.

    python examples/grpo_step.py      # CPU, a few seconds: builds a tiny model, takes one step

This is the step ``tidal ppo --advantage_estimator group_norm`` takes, written out with tidal's
building blocks (``tidal.rollout.LLMEngine`` samples, ``tidal.algorithms`` holds the math) and no
trainer class. ``tests/examples/test_grpo_step.py`` checks that it gives the same loss, gradient norm
and updated weights as one step of ``tidal ppo`` run with ``GRPOConfig.flags()``.

Read the functions in order: ``pick_prompts`` → ``sample`` → ``reward_func`` → ``group_advantages`` →
``grpo_loss_backward`` → ``optimizer_step``; ``grpo_step`` chains them and ``main`` runs one step.

Settings that keep the step simple (each is a ``tidal ppo`` flag, see ``GRPOConfig.flags``):

- one optimizer step per rollout (``--train_batch_size`` = every sample, ``--max_epochs 1``): the
  old log-probs equal the current ones, so the PPO ratio is 1 and the clip does not act yet; it
  matters when one rollout feeds several updates;
- GRPO's KL as a loss term (``--use_kl_loss --kl_estimator k3``), not a reward penalty;
- ``--lr_warmup_ratio 0``: the trainer's schedule would spend a one-step run at learning rate 0;
- no reward normalisation, overlong penalty or dynamic filtering (their defaults are off);
- float32 on the CPU.
"""

from __future__ import annotations

import copy
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from tidal.algorithms import aggregate_loss, compute_kl, gather_logprobs, group_normalized, ppo_policy_loss
from tidal.data import step_batches
from tidal.rollout import EngineConfig, LLMEngine, SamplingParams
from tidal.rollout.runner.sampler import sequence_seed
from tidal.testing import AdditionTask, build_tiny_model
from tidal.testing.tasks import digit_credit


@dataclass(frozen=True)
class GRPOConfig:
    """The knobs of one step, each named after the ``tidal ppo`` flag that sets it."""

    prompts_per_step: int = 4  # --rollout_batch_size
    samples_per_prompt: int = 8  # --n_samples_per_prompt: the group GRPO compares within
    max_new_tokens: int = 8  # --generate_max_len
    prompt_max_len: int = 16  # --prompt_max_len (the engine's context: prompt + response)
    temperature: float = 1.0  # --temperature
    micro_batch_size: int = 8  # --micro_train_batch_size (and --micro_rollout_batch_size)
    clip_eps: float = 0.2  # --eps_clip
    kl_coef: float = 1e-3  # --init_kl_coef, with --use_kl_loss --kl_estimator k3
    reward_clip: float = 10.0  # --reward_clip_range -10 10 (the default)
    learning_rate: float = 1e-3  # --actor_learning_rate (large: a tiny random model, one step)
    adam_betas: tuple[float, float] = (0.9, 0.95)  # --adam_betas (AdamW without weight decay: --l2 0)
    max_norm: float = 1.0  # --max_norm
    seed: int = 42  # --seed

    def flags(self) -> list[str]:
        """The ``tidal ppo`` flags of this step (add --pretrain, --prompt_data, --save_path...)."""
        samples = self.prompts_per_step * self.samples_per_prompt
        return [
            "--advantage_estimator", "group_norm", "--use_kl_loss", "--kl_estimator", "k3",
            "--init_kl_coef", str(self.kl_coef), "--rollout_batch_size", str(self.prompts_per_step),
            "--n_samples_per_prompt", str(self.samples_per_prompt), "--train_batch_size", str(samples),
            "--max_epochs", "1", "--micro_train_batch_size", str(self.micro_batch_size),
            "--micro_rollout_batch_size", str(self.micro_batch_size),
            "--generate_max_len", str(self.max_new_tokens), "--prompt_max_len", str(self.prompt_max_len),
            "--temperature", str(self.temperature), "--eps_clip", str(self.clip_eps),
            "--reward_clip_range", str(-self.reward_clip), str(self.reward_clip),
            "--actor_learning_rate", str(self.learning_rate), "--lr_warmup_ratio", "0",
            "--adam_betas", *map(str, self.adam_betas), "--l2", "0", "--max_norm", str(self.max_norm),
            "--seed", str(self.seed),
        ]  # fmt: skip


@dataclass
class Rollout:
    """Every sample of a step as right-padded ``[N, T]`` tensors, prompt-major (prompt 0's group first)."""

    sequences: Tensor  # prompt + response token ids, then padding
    attention_mask: Tensor  # 1 on real tokens
    action_mask: Tensor  # 1 on response tokens: the only tokens the loss ever touches
    responses: list[str]


@dataclass
class StepResult:
    loss: float
    grad_norm: float  # before clipping, as tidal ppo logs it
    rewards: Tensor  # [N]
    advantages: Tensor  # [N]: one number per sample, shared by all its tokens
    responses: list[str]


def pick_prompts(dataset: list[dict], cfg: GRPOConfig, episode: int = 0, step: int = 0):
    """0. PROMPTS. Like the trainer, reshuffle the dataset each episode (seeded, so a resumed run
    sees the same order) and take the ``step``-th batch of ``prompts_per_step`` prompts."""
    rows = step_batches(len(dataset), cfg.prompts_per_step, cfg.seed, episode)[step]
    return [dataset[i]["prompt"] for i in rows], [dataset[i]["label"] for i in rows]


def sample(engine: LLMEngine, tokenizer, prompts: list[str], cfg: GRPOConfig, step: int = 0) -> Rollout:
    """1. SAMPLE ``samples_per_prompt`` responses per prompt from the engine (the current policy).

    Every prompt gets a seed of its own derived from the step's seed, so a run is reproducible and
    equal prompts do not share their noise; the engine derives the n samples' seeds from it."""
    step_seed = cfg.seed * 1_000_003 + step
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    params = [
        SamplingParams(n=cfg.samples_per_prompt, temperature=cfg.temperature,
                       max_new_tokens=cfg.max_new_tokens, seed=sequence_seed(step_seed, i))
        for i in range(len(prompts))
    ]  # fmt: skip
    outputs = engine.generate(prompt_ids, params)
    rows = [(ids, c.token_ids) for ids, out in zip(prompt_ids, outputs, strict=True) for c in out.outputs]
    width = max(len(p) + len(r) for p, r in rows)
    sequences = torch.full((len(rows), width), tokenizer.pad_token_id)
    attention_mask, action_mask = torch.zeros_like(sequences), torch.zeros_like(sequences)
    for i, (p, r) in enumerate(rows):
        sequences[i, : len(p) + len(r)] = torch.tensor(p + r)
        attention_mask[i, : len(p) + len(r)] = 1
        action_mask[i, len(p) : len(p) + len(r)] = 1
    responses = [c.text for out in outputs for c in out.outputs]
    return Rollout(sequences, attention_mask, action_mask, responses)


# A random-init model almost never writes the right sum, and all-zero rewards give every group a zero
# baseline-corrected reward (no signal): a small bonus for answering in digits at all gives it one.
DIGIT_BONUS = 0.1


def reward_func(queries: list[str], prompts: list[str], labels: list, **kwargs) -> dict:
    """2. REWARD: a rule, no reward model. 1.0 for the right sum, partial credit per right digit
    (``digit_credit``), plus ``DIGIT_BONUS`` x the share of the response's characters that are digits.

    OpenRLHF's reward-function signature (queries are prompt + response), so ``tidal ppo
    --remote_rm_url examples/grpo_step.py`` scores with this very function."""
    rewards, exact = [], []
    for query, prompt, label in zip(queries, prompts, labels, strict=True):
        response = query[len(prompt) :]
        credit = digit_credit(response, str(label))
        digits = sum(ch.isdigit() for ch in response) / max(len(response), 1)
        rewards.append(credit + DIGIT_BONUS * digits)
        exact.append(float(credit == 1.0))
    return {"rewards": torch.tensor(rewards), "scores": torch.tensor(exact)}


def group_advantages(rewards: Tensor, cfg: GRPOConfig) -> Tensor:
    """3. GROUP BASELINE: GRPO needs no critic. A sample's advantage is how much better it did than
    its siblings (same prompt): (r − mean) / (std + 1e−9) within each group of ``samples_per_prompt``,
    clipped to ``reward_clip``. Every token of the response gets its sample's advantage. A group whose
    samples all score alike gets zeros: GRPO learns only from differences within a group."""
    return group_normalized(rewards, cfg.samples_per_prompt).clamp(-cfg.reward_clip, cfg.reward_clip)


def token_logprobs(model, rollout: Rollout, rows: list[int], temperature: float) -> Tensor:
    """log π(token_t | tokens before t) for every column t of ``rows`` (column 0 has no context: 0),
    at the sampling temperature, so that it is the distribution the engine sampled from."""
    ids = rollout.sequences[rows]
    logits = model(input_ids=ids, attention_mask=rollout.attention_mask[rows]).logits
    logp = gather_logprobs(logits[:, :-1], ids[:, 1:], temperature)
    return torch.cat([logp.new_zeros(ids.shape[0], 1), logp], dim=1)


def micro_batches(rows: list[int], size: int) -> list[list[int]]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


@torch.no_grad()
def frozen_logprobs(model, rollout: Rollout, cfg: GRPOConfig) -> Tensor:
    """Log-probs without gradient, micro-batch by micro-batch: the policy's before the update (the
    PPO ratio's denominator) and the frozen reference model's (the KL's anchor)."""
    model.eval()
    batches = micro_batches(list(range(len(rollout.responses))), cfg.micro_batch_size)
    return torch.cat([token_logprobs(model, rollout, rows, cfg.temperature) for rows in batches])


def grpo_loss_backward(
    policy, reference, rollout: Rollout, advantages: Tensor, cfg: GRPOConfig, step: int = 0
) -> float:
    """4. LOSS: the clipped PPO surrogate on every response token, plus β·KL(policy ‖ reference).

    Micro-batches accumulate gradients; each divides its summed token loss by the tokens of the
    *whole step*, so the micro-batch size never changes the update (a long response weighs more
    than a short one: the "token" mean, tidal's and OpenRLHF's default). Samples are shuffled first,
    seeded as ``tidal ppo`` does (when a rollout feeds several optimizer steps each then sees a mix
    of prompts; here it only makes the float rounding the trainer's)."""
    old_logp = frozen_logprobs(policy, rollout, cfg)
    ref_logp = frozen_logprobs(reference, rollout, cfg)
    token_advantages = advantages[:, None] * rollout.action_mask
    num_tokens = float(rollout.action_mask.sum())
    policy.train()
    total = 0.0
    shuffled = torch.randperm(
        len(rollout.responses), generator=torch.Generator().manual_seed(cfg.seed * 7919 + step)
    )
    for rows in micro_batches(shuffled.tolist(), cfg.micro_batch_size):
        mask = rollout.action_mask[rows]
        logp = token_logprobs(policy, rollout, rows, cfg.temperature)
        per_token, _ = ppo_policy_loss(logp, old_logp[rows], token_advantages[rows], mask, cfg.clip_eps)
        per_token = per_token + cfg.kl_coef * compute_kl(logp, ref_logp[rows], mask, "k3")
        loss = aggregate_loss(per_token, mask, "token", num_tokens=num_tokens)
        loss.backward()
        total += float(loss.detach())
    return total


def optimizer_step(policy, optimizer, engine: LLMEngine, cfg: GRPOConfig) -> float:
    """5. STEP: clip the gradient norm, update the weights, and copy them into the engine so the
    next rollout samples from the new policy. Returns the norm before clipping."""
    grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_norm))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    engine.update_weights(policy.named_parameters())
    return grad_norm


def grpo_step(
    policy, reference, optimizer, engine, tokenizer, prompts, labels, cfg: GRPOConfig, step: int = 0
) -> StepResult:
    """Step ``step`` of a run: sample → reward → group baseline → loss → step."""
    rollout = sample(engine, tokenizer, prompts, cfg, step)
    n = cfg.samples_per_prompt
    group_prompts = [p for p in prompts for _ in range(n)]
    group_labels = [label for label in labels for _ in range(n)]
    queries = [p + r for p, r in zip(group_prompts, rollout.responses, strict=True)]
    rewards = reward_func(queries, group_prompts, group_labels)["rewards"].float()
    advantages = group_advantages(rewards, cfg)
    loss = grpo_loss_backward(policy, reference, rollout, advantages, cfg, step)
    grad_norm = optimizer_step(policy, optimizer, engine, cfg)
    return StepResult(loss, grad_norm, rewards, advantages, rollout.responses)


def build(model_path: str | Path, cfg: GRPOConfig):
    """Policy, frozen reference, AdamW and engine for ``model_path`` (what ``tidal ppo`` builds)."""
    policy = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(
        policy.parameters(), lr=cfg.learning_rate, betas=cfg.adam_betas, weight_decay=0.0
    )
    engine_cfg = EngineConfig(
        max_model_len=cfg.prompt_max_len + cfg.max_new_tokens, device="cpu", seed=cfg.seed
    )
    return policy, reference, optimizer, LLMEngine(str(model_path), engine_cfg)


def main() -> None:
    cfg = GRPOConfig()
    torch.manual_seed(cfg.seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(Path(tmp) / "policy", "llama", seed=0)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        policy, reference, optimizer, engine = build(path, cfg)
        prompts, labels = pick_prompts(AdditionTask(seed=0).samples(cfg.prompts_per_step), cfg)
        result = grpo_step(policy, reference, optimizer, engine, tokenizer, prompts, labels, cfg)
    n = cfg.samples_per_prompt
    first = f"{prompts[0]!r} -> {result.responses[0]!r}"
    print(f"sampled {n} responses for each of {len(prompts)} prompts, e.g. {first}")
    for g, prompt in enumerate(prompts):  # one line per group: its rewards, then its advantages
        group = slice(g * n, (g + 1) * n)
        print(f"  {prompt:<8} rewards    {[round(r, 3) for r in result.rewards[group].tolist()]}")
        print(f"  {'':<8} advantages {[round(a, 2) for a in result.advantages[group].tolist()]}")
    print(f"loss {result.loss:.6f}, gradient norm {result.grad_norm:.4f} (clipped to {cfg.max_norm}); "
          "took one AdamW step and synced the engine")  # fmt: skip


if __name__ == "__main__":
    main()
