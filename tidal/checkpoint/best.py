"""The best checkpoint by an evaluation metric (``--best_metric_key``, OpenRLHF's ``--ckpt.best_metric_key``).

After each evaluation, when the chosen metric beats the best value so far (higher is better, as in
OpenRLHF), the run's whole resumable state is written to ``<--ckpt_path>/best_global_step_N`` (and, with
``--save_hf_ckpt``, a Hugging Face copy to ``best_global_step_N_hf``); then this run's previous best is
removed. The rolling checkpoints neither count nor remove it (``--max_ckpt_num``) and ``latest`` never
names it. The best value, its step and folder are part of every rolling checkpoint (the ``best`` state),
so a resumed run goes on comparing against them.

Metric names: tidal's RL evaluation logs ``eval/<name>`` (``pass@1``, ``pass@k``, ``reward``, ``score`` and
the reward function's own logs). ``--best_metric_key`` takes the name with or without ``eval/``; OpenRLHF's
``eval_<source>_pass<k>`` names (its help's example is ``eval_default_pass1``) mean ``pass@<k>``, tidal
pooling the evaluation prompts. Empty (the default) is OpenRLHF's auto-detection of a pass@1 metric:
``pass@1``; ``none`` keeps no best checkpoint.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from tidal.checkpoint.resumable import PREFIX, LoopState, read_meta
from tidal.config.args import ConfigError
from tidal.config.checkpoint import best_metric_name
from tidal.logging import get_logger

log = get_logger(__name__)

BEST = f"best_{PREFIX}"  # best_global_step_N


@dataclass
class BestRecord:
    """The best evaluation so far: the metric, its value, the step and the folder (in ``--ckpt_path``)."""

    metric: str | None = None
    value: float | None = None
    step: int | None = None
    folder: str | None = None


class BestCheckpoint:
    """Keeps the best checkpoint of a run (see the module docstring); a ``Stateful`` of its checkpoints.

    ``checkpointer``: the run's ``tidal.checkpoint.Checkpointer``, which writes the resumable state
    (``save(loop, name)``) and the Hugging Face copy (its ``hf_copy``)."""

    def __init__(self, key: str, checkpointer) -> None:
        self.key, self.checkpointer = key, checkpointer
        cfg = checkpointer.cfg
        # with neither the resumable state nor the HF copy there is nothing to keep (as in OpenRLHF)
        writes = not cfg.disable_ds_ckpt or (cfg.save_hf_ckpt and checkpointer.hf_copy is not None)
        self.metric = best_metric_name(key) if writes else None
        self.record = BestRecord(self.metric)

    # ---- Stateful -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return asdict(self.record)

    def load_state_dict(self, state: dict) -> None:
        saved = BestRecord(**state) if state else BestRecord()
        if saved.value is not None and saved.metric != self.metric:
            log.warning("the checkpoint's best eval/%s (%g at step %s) is not this run's --best_metric_key "
                        "metric: comparing from scratch", saved.metric, saved.value, saved.step)  # fmt: skip
            saved = BestRecord(self.metric)
        self.record = saved

    # ---- after an evaluation ------------------------------------------------------------------
    def update(self, metrics: dict[str, float], loop: LoopState) -> Path | None:
        """Write the best checkpoint of ``loop`` when ``metrics`` (one evaluation, without ``eval/``) beat the
        best so far; the folder written, or None. Every rank calls it (the save is collective)."""
        if self.metric is None:
            return None
        if self.metric not in metrics:
            logged = ", ".join(f"eval/{k}" for k in sorted(metrics))
            raise ConfigError(f"--best_metric_key {self.key}: the evaluation logs no eval/{self.metric} "
                              f"(it logs {logged})")  # fmt: skip
        value = float(metrics[self.metric])
        best = self.record.value
        if math.isnan(value) or (best is not None and value <= best):
            return None
        previous, name = self.record.folder, f"{BEST}{loop.global_step}"
        self.record = BestRecord(self.metric, value, loop.global_step, name)  # saved in the checkpoint
        folder = self._write(name, loop)
        if self.checkpointer.world.is_main:
            self._remove_others(name, previous)
        log.info("best eval/%s so far: %g at step %d (%s)", self.metric, value, loop.global_step, folder)
        return folder

    def _write(self, name: str, loop: LoopState) -> Path:
        checkpointer, cfg = self.checkpointer, self.checkpointer.cfg
        folder = Path(cfg.ckpt_path) / name
        if not cfg.disable_ds_ckpt:
            checkpointer.save(loop, name=name)
        if cfg.save_hf_ckpt and checkpointer.hf_copy is not None:
            checkpointer.hf_copy(Path(cfg.ckpt_path) / f"{name}_hf")
        return folder

    def _remove_others(self, keep: str, previous: str | None) -> None:
        """Remove this run's other best checkpoints (and HF copies): the previous one, and any a kill left
        between writing a new best and removing the old (same lineage); other runs' are left alone."""
        root = Path(self.checkpointer.cfg.ckpt_path)
        lineage = self.checkpointer.runs.lineage
        names = {previous} if previous and previous != keep else set()
        names |= {f.name for f in root.glob(f"{BEST}*") if f.is_dir() and f.name != keep
                  and read_meta(f).get("lineage") == lineage}  # fmt: skip
        for stale in names:
            for path in (root / stale, root / f"{stale}_hf"):
                shutil.rmtree(path, ignore_errors=True)
