"""PPO updates: several epochs of minibatch steps over one rollout, for the policy and the critic.

``train_on_experience`` is the shared loop (shuffle → optimizer steps of ``--train_batch_size``
samples → micro-batches with gradient accumulation; optionally a ptx micro-batch after each policy
micro-batch, ``tidal.trainers.ppo.ptx``, and a hook after each optimizer step, the policy's EMA).
Loss normalisers count the action tokens (and
sequences) of the whole optimizer step across devices, so micro-batch size and device count never
change the update. ``PolicyLoss`` and ``ValueLoss`` are the two objectives; their math lives in
``tidal.algorithms``. A step with a non-finite loss or gradient norm is skipped and counted by the
part's ``NonFiniteGuard`` (``tidal.trainers.optim``). A zero gradient is not taken for an overflow when
the step's loss is flat in every model output it reads (``OutputGradients``: PPO's clipping can flatten
every token of a minibatch, most often the critic's in later epochs); such a step is applied, as
OpenRLHF applies every step (AdamW's momentum still moves the weights). Conversely a zero parameter
gradient while the loss does send gradient into those outputs is an overflow inside the model (an absurd
learning rate), skipped and counted whatever the loss (PPO's loss is near 0 by design).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from tidal.algorithms import (
    PolicyLossParams,
    aggregate_loss,
    aggregate_policy_loss,
    compute_kl,
    corrected_policy_loss,
    masked_mean,
    value_loss,
)
from tidal.config.rl import AlgorithmConfig
from tidal.distributed.collectives import max_over_world
from tidal.distributed.world import World
from tidal.experience.experience import Experience, forced_experts, micro_batches, model_batch, unflatten
from tidal.experience.maker import shift_values
from tidal.logging.phases import Progress
from tidal.models.forward import default_token_logprobs, spliced_logprobs, token_logprobs
from tidal.models.moe_routing import capture_router_logits, force_routing, router_aux_loss
from tidal.models.precision import Precision
from tidal.models.ring_attention import active_ring, turns
from tidal.trainers.loop import STEP_LOSS, backward, optimizer_step, reduce_metrics
from tidal.trainers.optimization import Optimization

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Normaliser:
    """Action tokens and sequences of one optimizer step, divided by the device count."""

    tokens: float
    sequences: float

    @classmethod
    def of(cls, exp: Experience, world: World) -> Normaliser:
        local = {"t": float(exp.action_mask.sum()), "s": float((exp.action_mask.sum(-1) > 0).sum())}
        total = reduce_metrics(local, world)  # mean over devices = total / world_size
        return cls(tokens=max(total["t"], 1.0), sequences=max(total["s"], 1.0))


@dataclass
class OutputGradients:
    """How much gradient one optimizer step's loss sends into the model outputs it reads (log-probs,
    entropies, the router loss, values): tensor hooks add up ``|grad|`` during the backward passes, so
    nothing is recomputed and the gradients pass unchanged.

    PPO's clipped losses have no gradient on a clipped token; when every token of a step is clipped the
    loss is flat and the parameters' gradient is exactly 0 by design, which the non-finite guard must
    not take for an overflow inside the model. ``known`` is False when a loss term reads outputs that
    are not watched (a custom loss, the ptx loss): then the guard's plain rule applies."""

    watched: bool = False
    unwatched: bool = False
    total: Tensor | float = 0.0

    @contextlib.contextmanager
    def recording(self) -> Iterator[OutputGradients]:
        """Makes ``watch_outputs`` (called by the loss functions) register on this step."""
        token = _RECORDING.set(self)
        try:
            yield self
        finally:
            _RECORDING.reset(token)

    def watch(self, output: Tensor) -> None:
        if output.requires_grad:
            self.watched = True
            output.register_hook(self._add)

    def _add(self, grad: Tensor) -> None:
        self.total = self.total + grad.detach().float().abs().sum()  # |g|: no underflow of tiny squares

    @property
    def known(self) -> bool:
        return self.watched and not self.unwatched


_RECORDING: ContextVar[OutputGradients | None] = ContextVar("tidal_output_gradients", default=None)


def watch_outputs(*outputs: Tensor | None) -> None:
    """Record the gradient the loss sends into ``outputs`` for the step being trained (if any)."""
    recording = _RECORDING.get()
    if recording is not None:
        for output in outputs:
            if output is not None:
                recording.watch(output)


# The step's summed |gradient| into the watched model outputs, reduced over ranks with the metrics.
OUTPUT_GRADIENT = "_output_gradient"


# Engine vs trainer log-prob gap (mean |old - rollout| over action tokens), logged by the PPO trainer.
MISMATCH = "rollout/logprob_mismatch"
# --exact_logprobs: samples of each on-policy step whose exact forward checks the engine's log-probs
# (``PolicyLoss._check``; the step's first micro-batch, all of it where it holds fewer)
EXACT_CHECK_SAMPLES = 8


def old_logprobs_from_update(epochs: int, rollout_size: int, step_size: int, has_reference: bool) -> bool:
    """Whether the update can take the old log-probs from its own forward instead of a scoring pass.

    When the whole rollout is one optimizer step of one epoch (``rollout_size <= step_size``), every
    micro-batch's forward runs on the weights a scoring pass would have used, since no optimizer step
    has moved them yet. Its log-probs, detached, are then the old ones: the ratio is exactly 1 and its
    gradient is the policy gradient (as TRL's GRPO does when on-policy). A
    reference model needs the old log-probs before the update (the KL in the reward and its statistic),
    so it keeps the scoring pass. OpenRLHF always runs the pass; this saves one forward over the rollout.
    """
    return epochs == 1 and rollout_size <= step_size and not has_reference


@dataclass
class StepShape:
    """How a rollout is cut: samples per optimizer step (this device), per micro-batch, token budget."""

    step_size: int
    micro_size: int
    max_tokens: int | None = None
    epochs: int = 1
    packing: bool = False


def train_on_experience(
    opt: Optimization,
    exp: Experience,
    loss_fn: Callable,
    shape: StepShape,
    world: World,
    generator: torch.Generator,
    extra_loss: Callable[[nn.Module, int], tuple[Tensor, dict]] | None = None,
    after_step: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Run ``shape.epochs`` passes of optimizer steps over ``exp``; returns metrics averaged over steps.

    ``extra_loss(model, micro_batches)``, when given, is backpropagated separately after each
    micro-batch's loss (the ptx loss: one graph at a time) and counts in the step's loss;
    ``after_step()`` runs after each optimizer step (the EMA update)."""
    totals: dict[str, float] = {}
    steps = 0
    opt.model.train()
    progress = training_progress(type(loss_fn).__name__, len(exp), shape, world)
    for _ in range(shape.epochs):
        order = torch.randperm(len(exp), generator=generator)
        for start in range(0, len(exp), shape.step_size):
            step = exp.select(order[start : start + shape.step_size])
            norm = Normaliser.of(step, world)
            sums: dict[str, float] = {STEP_LOSS: 0.0}
            groups = _micro_batches(step, shape, world)
            outputs = OutputGradients(unwatched=extra_loss is not None)  # the ptx loss reads the logits
            with outputs.recording():
                for mine, mb in _turns(step, groups, world):
                    loss, metrics = loss_fn(opt.model, mb, norm)
                    backward(loss, opt.precision)
                    progress.update(1)
                    if not mine:  # a ring peer's micro-batch (ring attention): its owner counts it
                        continue
                    sums[STEP_LOSS] += float(loss.detach())
                    if extra_loss is not None:
                        extra, extra_metrics = extra_loss(opt.model, len(groups))
                        backward(extra, opt.precision)
                        sums[STEP_LOSS] += float(extra.detach())
                        metrics = {**metrics, **extra_metrics}
                    for k, v in metrics.items():
                        sums[k] = sums.get(k, 0.0) + float(v)
            sums[OUTPUT_GRADIENT] = float(outputs.total)
            metrics = reduce_metrics(sums, world)  # every rank sees the same loss, so all skip together
            into_outputs = metrics.pop(OUTPUT_GRADIENT)
            flat = outputs.known and into_outputs == 0.0  # no gradient into the outputs on any rank
            # a zero parameter gradient while the outputs get one: the model overflowed inside (huge lr)
            measured = into_outputs if outputs.known else None
            opt.guard.observe_loss(metrics.pop(STEP_LOSS), flat=flat, into_outputs=measured)
            metrics["grad_norm"] = optimizer_step(opt)
            if after_step is not None:
                after_step()
            metrics["lr"] = opt.scheduler.get_last_lr()[0]
            opt.scheduler.step()
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + v
            steps += 1
    progress.close()
    return {k: v / max(steps, 1) for k, v in totals.items()}


def training_progress(what: str, rows: int, shape: StepShape, world: World) -> Progress:
    """Micro-batches (forward + backward) of this update, logged as they go; the count is known up front
    unless a token budget (``--use_dynamic_batch``) splits them."""
    steps = shape.epochs * -(-rows // shape.step_size)
    per_step = None if shape.max_tokens else -(-min(rows, shape.step_size) // shape.micro_size)
    total = None if per_step is None else steps * per_step
    return Progress(
        f"training ({what}, {steps} optimizer steps)", total, "micro-batches", quiet=not world.is_main
    )


def _micro_batches(step: Experience, shape: StepShape, world: World) -> list[list[int]]:
    """Micro-batches of this rank's step; under a token budget every rank gets the same count (each
    sharded forward is a collective), splitting the largest micro-batches where a rank has fewer."""
    groups = micro_batches(step, shape.micro_size, shape.max_tokens)
    if shape.max_tokens is None or not world.distributed:
        return groups
    target = max_over_world(len(groups), world)
    while len(groups) < target:
        largest = max(range(len(groups)), key=lambda i: len(groups[i]))
        rows = groups.pop(largest)
        if len(rows) < 2:
            raise RuntimeError(f"cannot split {len(step)} rows into {target} micro-batches")
        groups[largest:largest] = [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
    return groups


def _turns(step: Experience, groups: list[list[int]], world: World):
    """``(mine, micro-batch)`` of this step. Under ring attention the ring group takes turns
    (``tidal.models.ring_attention.turns``): every rank runs every rank's micro-batches, each over its
    chunk of the sequence, and only the owner counts the loss (the ring's gradients sum to it)."""
    ring = active_ring()
    if ring is None:
        return ((True, step.select(rows)) for rows in groups)
    parts = [step.select(rows).to(torch.device("cpu")) for rows in groups]
    return ((mine, mb.to(world.device)) for mine, mb in turns(parts, ring))


def _share(value: Tensor, mask: Tensor, norm: Normaliser) -> Tensor:
    """A micro-batch mean turned into its contribution to the step mean (weighted by tokens)."""
    return value.detach() * mask.sum() / norm.tokens


@dataclass
class PolicyLoss:
    """Clipped policy loss (+ KL loss, entropy bonus, mismatch correction) for one micro-batch."""

    cfg: AlgorithmConfig
    precision: Precision
    temperature: float
    packing: bool
    kl_coef: float = 0.0
    aux_loss_coef: float = 0.0  # --aux_loss_coef: MoE load-balancing loss weight (0 on dense models)
    # --moe_router_replay: route as the engine did. The forced experts stay set after the forward, so a
    # checkpointing recompute in backward routes alike; the caller clears them (``force_routing(m, None)``).
    router_replay: bool = False
    # --exact_logprobs with the engine generating on the weights being trained (not --async_train): an
    # on-policy step's exact values are the engine's log-probs bit for bit, so its micro-batches take the
    # engine's values with the default forward's gradient (``_takes_engine_values``), and the exact forward
    # runs once a step, on the first ``EXACT_CHECK_SAMPLES`` samples, to measure the mismatch (``_check``)
    engine_exact: bool = False
    loss_params: PolicyLossParams = field(init=False)  # the chosen loss's own: clip ε or SAPO's τ
    _checked: Normaliser | None = field(default=None, init=False, repr=False)  # the step checked last
    _warned: bool = field(default=False, init=False, repr=False)

    def __post_init__(self):
        self.loss_params = self.cfg.policy_loss_params()

    def _takes_engine_values(self, mb: Experience, norm: Normaliser) -> bool:
        """Whether this micro-batch takes the engine's log-probs as its exact values (no exact forward): an
        on-policy step in ``engine_exact`` mode."""
        return self.engine_exact and mb.old_logprobs is None

    def _check(self, model: nn.Module, mb: Experience, norm: Normaliser) -> dict[str, Tensor]:
        """Once a step (``norm`` is one step's own object; else nothing): the exact forward of the
        micro-batch's first ``EXACT_CHECK_SAMPLES`` samples against the engine's log-probs, the premise of
        ``_takes_engine_values``: its mean |gap| as the step's mismatch metric (0.0), and a warning, once a
        run, where it is not 0. A few samples check it as well as a micro-batch (a row's exact values are
        a function of that row alone) at a fraction of the exact forward's cost."""
        if self._checked is norm:
            return {}
        self._checked = norm
        rows = mb.select(torch.arange(min(len(mb), EXACT_CHECK_SAMPLES)))
        if self.router_replay:  # the exact router picks the engine's experts itself; replay's hook would
            force_routing(model, None)  # recompute their weights in plain torch (``forward._hooks_off``)
        with torch.no_grad(), self.precision.autocast():
            exact, _ = token_logprobs(model, model_batch(rows, self.packing), self.temperature)
        exact = unflatten(exact, rows, self.packing)
        mismatch = masked_mean((exact - rows.rollout_logprobs).abs(), rows.action_mask)
        if not self._warned and float(mismatch) != 0.0:
            self._warned = True  # the premise of the engine's values failed: say so, loudly
            log.warning(
                "--exact_logprobs: the trainer's exact log-probs differ from the engine's (mean |gap| %.3g); "
                "exact mode does not hold for this model or setup: please report it",
                float(mismatch),
            )
        return {MISMATCH: mismatch}

    def __call__(self, model: nn.Module, mb: Experience, norm: Normaliser):
        cfg, mask = self.cfg, mb.action_mask
        engine_values = self._takes_engine_values(mb, norm)
        checked = self._check(model, mb, norm) if engine_values else {}
        if self.router_replay:
            force_routing(model, forced_experts(mb, self.packing))
        routers = capture_router_logits(model) if self.aux_loss_coef > 0 else contextlib.nullcontext([])
        forward = default_token_logprobs if engine_values else token_logprobs
        with self.precision.autocast(), routers as router_logits:
            logp, out = forward(
                model,
                model_batch(mb, self.packing),
                self.temperature,
                with_entropy=cfg.entropy_loss_coef is not None,
            )
        logp = unflatten(logp, mb, self.packing)
        if engine_values:  # the exact forward's values without running it (straight through, as it splices)
            logp = spliced_logprobs(mb.rollout_logprobs, logp)
        watch_outputs(logp)
        correction = ("icepop" if cfg.use_icepop else "tis") if cfg.enable_vllm_is_correction else None
        old = mb.old_logprobs
        if old is None:  # on-policy step (``old_logprobs_from_update``): the weights have not moved yet
            old = logp.detach()
        per_token, stats = corrected_policy_loss(
            cfg.policy_loss_type, logp, old, mb.advantages, mask, self.loss_params,
            mb.rollout_logprobs, correction, cfg.is_bounds,
        )  # fmt: skip
        metrics = {f"policy/{k}": _share(v, mask, norm) for k, v in stats.items()} | checked
        if mb.old_logprobs is None and not engine_values:  # what the skipped scoring pass would have given
            mismatch = masked_mean((old - mb.rollout_logprobs).abs(), mask)
            metrics[MISMATCH] = _share(mismatch, mask, norm)
        terms = []  # per-token KL-loss and entropy terms: token means in every mode, as OpenRLHF
        if cfg.use_kl_loss and mb.ref_logprobs is not None:
            kl = compute_kl(logp, mb.ref_logprobs, mask, cfg.kl_estimator)
            terms.append(self.kl_coef * kl)
            metrics["policy/kl_loss"] = _share(masked_mean(kl, mask), mask, norm)
        if cfg.entropy_loss_coef is not None:
            entropy = unflatten(out.entropy, mb, self.packing)  # of the sampling distribution
            watch_outputs(entropy)
            terms.append(-cfg.entropy_loss_coef * entropy)
            metrics["policy/entropy"] = _share(masked_mean(entropy, mask), mask, norm)
        loss = aggregate_policy_loss(
            per_token, terms, mask, cfg.loss_aggregation, num_tokens=norm.tokens, num_sequences=norm.sequences
        )
        if self.aux_loss_coef > 0:
            # Packed rows hold only real tokens; padded rows count only the attended ones.
            tokens = None if self.packing else mb.attention_mask
            aux = router_aux_loss(model, router_logits, tokens)
            aux = logp.new_zeros(()) if aux is None else aux  # dense: no router, no loss (OpenRLHF)
            watch_outputs(aux)  # the router loss always has a gradient: never flat
            # The step's loss is a sum over micro-batches, so each adds its token share of the aux loss.
            share = mask.sum() / norm.tokens
            loss = loss + self.aux_loss_coef * aux * share
            metrics["policy/aux_loss"] = aux.detach() * share
        metrics["policy/loss"] = loss.detach()
        return loss, metrics


@dataclass
class ValueLoss:
    """Clipped value loss against the returns, token-mean over the step."""

    value_clip: float | None
    precision: Precision
    packing: bool

    def __call__(self, critic: nn.Module, mb: Experience, norm: Normaliser):
        mask = mb.action_mask
        with self.precision.autocast():
            values = shift_values(critic.values(model_batch(mb, self.packing)))
        values = unflatten(values.float(), mb, self.packing)
        watch_outputs(values)
        per_token, stats = value_loss(values, mb.values, mb.returns, mask, clip_eps=self.value_clip)
        loss = aggregate_loss(per_token, mask, "token", num_tokens=norm.tokens)
        metrics = {
            "critic/loss": loss.detach(),
            **{f"critic/{k}": _share(v, mask, norm) for k, v in stats.items()},
        }
        return loss, metrics
