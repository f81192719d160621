"""Rollout batches assembled from prompt groups: dynamic filtering that refills the batch and
over-sampling (OpenRLHF's semantics), and where the episode stands so a resume trains each prompt once.

A *generation call* draws ``--vllm_generate_batch_size`` prompts (G; default ``--rollout_batch_size``, B)
from the episode's prompt order and samples ``n`` responses for each (one *group* per prompt), scored.
With ``--dynamic_filtering`` a group whose mean score is not strictly inside
``--dynamic_filtering_reward_range`` is dropped and one more prompt is drawn in its place (generated in
the call's next round), until the call holds as many accepted groups as it drew prompts at first or the
episode's prompts run out (OpenRLHF v0.9.2+ ``SamplesGenerator._generate_vllm``). Accepted groups wait in
a buffer, in prompt order; each step trains the buffer's first B groups, and a call runs only when the
buffer holds fewer than B, so with G > B the extra groups feed the next steps. When the episode's prompts
run out, the fewer than B groups left are not trained (logged), as tidal always leaves an episode's last
partial batch out.

Every batch carries its ``BatchPosition``: how many prompts of the episode's order had been drawn when it
was cut, the groups still buffered (generated and scored, untrained) and the next round's seed. A
checkpoint written after training that batch keeps this position, buffered groups included, so a resume
(also after ``kill -9`` in ``--async_train``, whose thread had generated further ahead: those rollouts
were never part of a checkpoint and are generated again) trains the buffered groups first and goes on
from the drawn count: no prompt is trained twice or skipped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from tidal.algorithms import dynamic_filter_mask
from tidal.data.prompts import PromptSample
from tidal.experience.experience import Experience
from tidal.logging import get_logger
from tidal.trainers.ppo.stream import MakeExperience, RolloutJob, RolloutResult

log = get_logger(__name__)


@dataclass(frozen=True)
class BatchPosition:
    """Where the episode stood when a batch was cut: prompts drawn from its order, the prompts whose groups
    were still buffered and those groups (generated and scored, not yet trained), and the next generation
    round (its seed); ``rounds`` None: the episode's first."""

    episode: int
    drawn: int
    pending: tuple[int, ...] = ()
    rounds: int | None = None
    groups: tuple[Experience, ...] = field(default=(), compare=False, repr=False)

    def state_dict(self) -> dict:
        """What a checkpoint keeps (``torch.save``: the buffered groups' tensors on the CPU)."""
        groups = [g.to(torch.device("cpu")) for g in self.groups]
        return {"episode": self.episode, "drawn": self.drawn, "pending": list(self.pending),
                "rounds": self.rounds, "groups": groups}  # fmt: skip

    @staticmethod
    def from_state(state: dict) -> BatchPosition:
        pending, groups = tuple(int(i) for i in state["pending"]), tuple(state.get("groups", ()))
        if len(groups) != len(pending):
            raise ValueError(
                f"checkpoint sampling state: {len(groups)} buffered groups, {len(pending)} prompts"
            )
        return BatchPosition(int(state["episode"]), int(state["drawn"]), pending, state.get("rounds"), groups)


@dataclass(frozen=True)
class SamplingConfig:
    """How batches are assembled: B groups a step, G prompts a call, and the filter's score range."""

    batch: int  # --rollout_batch_size
    generate: int  # --vllm_generate_batch_size (prompts a generation call starts with)
    n: int
    temperature: float
    reward_range: tuple[float, float] | None = None  # --dynamic_filtering (None: off)
    # several processes: each round is one batch, its experience this rank's share (not split into groups)
    whole_rounds: bool = False
    max_staleness: int | None = None  # --max_staleness (with --async_train)


@dataclass
class _Group:
    prompt: int  # index into the run's prompts
    exp: Experience | None  # its n samples, scored (whole rounds: the round's share on its first group)
    version: int = 0  # the policy it was generated with: steps trained (``RolloutBatcher.trained``) then


@dataclass
class _Counts:
    """What the calls since the last batch did (the next batch's ``dynamic_filter/*`` metrics)."""

    drawn: int = 0
    filtered: int = 0
    refilled: int = 0
    logs: list[tuple[int, dict]] = field(default_factory=list)  # (prompts, reward logs) per round


class RolloutBatcher:
    """Yields the episode's rollout batches (see the module docstring); ``make`` generates and scores."""

    def __init__(
        self,
        cfg: SamplingConfig,
        prompts: Sequence[PromptSample],
        make: MakeExperience,
        seed_of: Callable[[int], int],
    ):
        self.cfg, self.prompts, self.make, self.seed_of = cfg, prompts, make, seed_of
        # steps trained and batches handed out by this run (the trainer calls ``trained_one``): a group's
        # version and the --max_staleness bound; the generation thread waits on ``_progress``
        self.trained, self.handed_out = 0, 0
        self._progress = threading.Condition()

    def trained_one(self) -> None:
        """The trainer finished a step (its update and weight sync)."""
        with self._progress:
            self.trained += 1
            self._progress.notify_all()

    def staleness(self, result: RolloutResult) -> dict[str, float]:
        """``async/staleness_mean|max``: steps between the weights a batch's groups started generating with
        and the step training them; ``async/stale_token_share``: the share of its action tokens an older
        policy generated (with partial rollouts a token sampled after an update counts that update). A
        synchronous batch is always 0."""
        if self.cfg.whole_rounds or not result.versions:
            return {}
        lag = torch.tensor([self.trained - v for v in result.versions], dtype=torch.long)
        exp = result.exp
        token_lag = lag.repeat_interleave(len(exp) // len(lag))[:, None].to(exp.action_mask.device)
        if exp.weight_updates is not None:  # --partial_rollout_enable
            token_lag = token_lag - exp.weight_updates
        mask = exp.action_mask.bool()
        stale = float(((token_lag > 0) & mask).sum() / mask.sum().clamp(min=1))
        return {"async/staleness_mean": float(lag.float().mean()), "async/staleness_max": float(lag.max()),
                "async/stale_token_share": stale}  # fmt: skip

    def _wait_for_staleness(self, buffered: int) -> None:
        """--max_staleness: hold the next round until its last group will train at most that many steps
        after now, or until every batch handed out has been trained (then waiting cannot help)."""
        bound = self.cfg.max_staleness
        if bound is None:
            return
        last = self.handed_out + (buffered + self.cfg.generate - 1) // self.cfg.batch
        with self._progress:
            self._progress.wait_for(lambda: last - self.trained <= bound or self.trained >= self.handed_out)

    def batches(
        self, episode: int, order: Sequence[int], start: BatchPosition, first_round: int
    ) -> Iterator[RolloutResult]:
        """Batches of ``episode`` whose prompts come in ``order``, resuming at ``start`` (its buffered
        groups first); the rounds' seeds are ``seed_of(first_round)``, ``seed_of(first_round + 1)``, ...
        (a resumed position goes on with its own round)."""
        buffer = [_Group(p, g) for p, g in zip(start.pending, start.groups, strict=True)]
        rounds = first_round if start.rounds is None else start.rounds
        drawn, counts, step = start.drawn, _Counts(), 0
        while True:
            t0 = time.perf_counter()
            while len(buffer) < self.cfg.batch and drawn < len(order):
                self._wait_for_staleness(len(buffer))
                groups, drawn, rounds = self._call(order, drawn, rounds, counts)
                buffer += groups
            if len(buffer) < self.cfg.batch:
                if buffer:
                    log.info("episode %d: its prompts ran out; %d buffered group(s), fewer than one "
                             "--rollout_batch_size, are not trained", episode, len(buffer))  # fmt: skip
                return
            batch, buffer = buffer[: self.cfg.batch], buffer[self.cfg.batch :]
            pending = tuple(g.prompt for g in buffer)
            position = BatchPosition(episode, drawn, pending, rounds, tuple(g.exp for g in buffer))
            self.handed_out += 1
            yield self._result(episode, step, batch, position, counts, time.perf_counter() - t0)
            step, counts = step + 1, _Counts()

    def _call(
        self, order: Sequence[int], drawn: int, rounds: int, counts: _Counts
    ) -> tuple[list[_Group], int, int]:
        """One generation call: G prompts, each filtered group replaced by a new prompt while any is left."""
        accepted: list[_Group] = []
        want = self.cfg.generate
        first = True
        while want > 0 and drawn < len(order):
            ids = list(order[drawn : drawn + want])
            drawn += len(ids)
            if not first:
                counts.refilled += len(ids)
            groups, filtered = self._round(ids, rounds, counts)
            rounds, first = rounds + 1, False
            accepted += groups
            want = filtered  # OpenRLHF draws one prompt per filtered group
        return accepted, drawn, rounds

    def _round(self, ids: list[int], round_index: int, counts: _Counts) -> tuple[list[_Group], int]:
        """Generate and score ``ids``' groups; the accepted ones (prompt order) and how many were filtered."""
        cfg = self.cfg
        job = RolloutJob(round_index, [self.prompts[i] for i in ids], cfg.n, cfg.temperature,
                         self.seed_of(round_index))  # fmt: skip
        # the engine's weights: this step's, or a later one's when a sync runs before the round takes the
        # rollout's lock (so a staleness is at most 1 above the truth, never below)
        version = self.trained
        exp, logs = self.make(job)
        counts.drawn += len(ids)
        counts.logs.append((len(ids), logs))
        if cfg.whole_rounds:  # this rank's share of the batch, kept whole
            return [_Group(ids[0], exp, version)] + [_Group(i, None, version) for i in ids[1:]], 0
        keep = torch.ones(len(ids), dtype=torch.bool)
        if cfg.reward_range is not None:
            keep = dynamic_filter_mask(exp.scores, cfg.n, *cfg.reward_range)[:: cfg.n].cpu()
        filtered = len(ids) - int(keep.sum())
        if filtered:
            lo, hi = cfg.reward_range
            log.info("dynamic filtering: %d of %d group(s) filtered out (mean score outside (%g, %g))",
                     filtered, len(ids), lo, hi)  # fmt: skip
        counts.filtered += filtered
        groups = [
            _Group(prompt, exp.select(range(k * cfg.n, (k + 1) * cfg.n)), version)
            for k, prompt in enumerate(ids)
            if keep[k]
        ]
        return groups, filtered

    def _result(
        self, episode: int, step: int, batch: list[_Group], position: BatchPosition, counts: _Counts, seconds
    ) -> RolloutResult:
        ids = [g.prompt for g in batch]
        exp = Experience.concat([g.exp for g in batch if g.exp is not None])
        job = RolloutJob(step, [self.prompts[i] for i in ids], self.cfg.n, self.cfg.temperature, -1)
        stats = {}
        if self.cfg.reward_range is not None:
            stats = {
                "dynamic_filter/filtered": float(counts.filtered),
                "dynamic_filter/refilled": float(counts.refilled),
                # OpenRLHF's dynamic_filtering_pass_rate: groups accepted per prompt drawn, in percent
                "dynamic_filter/pass_rate": 100.0 * (counts.drawn - counts.filtered) / max(counts.drawn, 1),
            }
        versions = [g.version for g in batch]
        return RolloutResult(job, exp, _mean_logs(counts.logs), seconds, ids, position, stats, versions)


def _mean_logs(logs: list[tuple[int, dict]]) -> dict:
    """The rounds' reward logs averaged, each round weighted by its prompts."""
    total: dict[str, float] = {}
    weight: dict[str, int] = {}
    for count, entry in logs:
        for key, value in entry.items():
            total[key] = total.get(key, 0.0) + float(value) * count
            weight[key] = weight.get(key, 0) + count
    return {key: total[key] / weight[key] for key in total}


class SamplingState:
    """The checkpoint's ``sampling`` entry: the ``BatchPosition`` of the last trained batch (a
    ``Stateful``); ``resumed`` is the one a resume starts from (None: a fresh run or an older checkpoint)."""

    def __init__(self) -> None:
        self.position: BatchPosition | None = None
        self.resumed: BatchPosition | None = None

    def state_dict(self) -> dict:
        return self.position.state_dict() if self.position is not None else {}

    def load_state_dict(self, state: dict) -> None:
        self.resumed = BatchPosition.from_state(state) if state else None

    def start(self, episode: int, skip: int) -> BatchPosition:
        """Where ``episode`` starts: the checkpoint's position in its episode, else after ``skip`` prompts."""
        if self.resumed is not None and self.resumed.episode == episode:
            return self.resumed
        return BatchPosition(episode, skip)


def sampling_config(run, distributed: bool) -> SamplingConfig:
    """The batches of ``run`` (a ``PPORun``). ``--dynamic_filtering`` refills in one process; with several
    (refilling would leave the ranks unequal shares) or ``--dynamic_filtering_no_refill`` the trainer
    filters the batch instead (``PPOTrainer._dynamic_filter``). Several processes over-sample nothing
    (``placement.data_parallel.check_data_parallel`` refuses it)."""
    r, a = run.rollout, run.algorithm
    refill = a.dynamic_filtering and not distributed and not a.dynamic_filtering_no_refill
    return SamplingConfig(
        max_staleness=run.placement.max_staleness,
        batch=r.rollout_batch_size,
        generate=r.vllm_generate_batch_size or r.rollout_batch_size,
        n=r.n_samples_per_prompt,
        temperature=r.temperature,
        reward_range=tuple(a.dynamic_filtering_reward_range) if refill else None,
        whole_rounds=distributed,
    )
