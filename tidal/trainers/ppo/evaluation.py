"""Evaluation during RL training (``--eval_dataset`` every ``--eval_steps`` steps) and the best checkpoint by
one of its metrics (``--best_metric_key``, ``tidal.checkpoint.best``).

Synchronous and ``--async_train`` runs evaluate alike: after step N's update and weight sync, on the
trainer's thread, so the engine holds step N's weights (OpenRLHF's async trainer evaluates on its
generation actor with whatever weights it has then). In async mode the generation thread may be making a
later rollout at that moment; the evaluation takes its turn between two of that thread's rounds (the
trainer's rollout turn covers a round's generation and scoring, so the two never interleave, and with
partial rollouts a weight sync cannot land during it: only the trainer's thread syncs). It touches nothing
the rollout or the resume bookkeeping keeps (the batcher's buffer and position) and draws no shared random
state (every sample is seeded by its own request), so a run trains the same with or without evaluation.

After step N: its ``eval/*`` metrics are logged at step N, then the best checkpoint is updated, then the
rolling checkpoint of step N is written (by the trainer), so that checkpoint records the best so far.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tidal.checkpoint.best import BestCheckpoint
from tidal.checkpoint.resumable import LoopState
from tidal.distributed.collectives import mean_over_world
from tidal.distributed.world import World
from tidal.inference.evaluation import pass_at_k_stats
from tidal.logging import MetricsLogger
from tidal.trainers.ppo.stream import MakeExperience, RolloutJob


class RLEvaluation:
    """``--eval_dataset`` every ``--eval_steps`` steps (``run``: a ``PPORun``); registers the best checkpoint's
    state with ``checkpointer`` (as ``best``). ``make`` generates and scores a job (the trainer's rollout
    turn); ``after_generation`` runs when the samples are made (the hybrid engine's sleep)."""

    def __init__(
        self,
        run,
        world: World,
        prompts: Sequence | None,
        make: MakeExperience,
        after_generation: Callable[[], None],
        checkpointer,
    ):
        self.run, self.world, self.prompts = run, world, prompts
        self.make, self.after_generation = make, after_generation
        self.best = BestCheckpoint(run.best.best_metric_key, checkpointer)
        checkpointer.state["best"] = self.best  # every rolling checkpoint keeps the best value and folder

    def due(self, step: int) -> bool:
        every = self.run.train.eval_steps
        return bool(self.prompts) and every > 0 and step % every == 0

    def after_step(self, loop: LoopState, logger: MetricsLogger) -> dict[str, float] | None:
        """Evaluate when step ``loop.global_step`` is due: log ``eval/*`` there and keep the best checkpoint;
        the metrics, or None."""
        if not self.due(loop.global_step):
            return None
        stats = self.evaluate()
        logger.log(loop.global_step, stats, prefix="eval")
        self.best.update(stats, loop)
        return stats

    def evaluate(self) -> dict[str, float]:
        """Mean reward and score of fresh samples on the evaluation prompts, and pass@1 / pass@k
        (k = --eval_n_samples_per_prompt; a sample passes when its score is >= --eval_pass_threshold)."""
        r = self.run.rollout
        job = RolloutJob(
            0, self.prompts, r.eval_n_samples_per_prompt, r.eval_temperature, self.run.train.seed
        )
        exp, logs = self.make(job)
        self.after_generation()
        stats = {"reward": float(exp.rewards.mean()), "score": float(exp.scores.mean()), **logs}
        # trajectories are prompt-major, so each prompt's samples are consecutive in exp.scores
        stats |= pass_at_k_stats(exp.scores.tolist(), r.eval_n_samples_per_prompt, r.eval_pass_threshold)
        return mean_over_world(stats, self.world, weight=len(exp))
