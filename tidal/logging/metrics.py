"""MetricsLogger: one ``log(step, metrics)`` call fans out to JSONL, TensorBoard and W&B.

The JSONL file ``<run_dir>/metrics.jsonl`` is always written (one object per call:
``{"step", "time", "<prefix>/<key>": value, ...}``) and is what ``plots.py`` reads. Resume keeps one
curve: entries after the resume step are dropped from the JSONL, TensorBoard purges them via
``purge_step``, and the W&B run id is stored in ``<run_dir>/logging_state.json`` and reused.
Closing waits until W&B has written its offline/transaction-log files (see ``_wait_for_wandb_files``).
Only the main rank logs; other ranks get a logger that does nothing.
"""

from __future__ import annotations

import json
import numbers
import os
import time
import uuid
from pathlib import Path
from typing import Any

from tidal.config.args import ConfigError
from tidal.config.logging import LoggingConfig, default_run_name
from tidal.logging.console import get_logger

METRICS_FILE = "metrics.jsonl"
STATE_FILE = "logging_state.json"

log = get_logger(__name__)


def to_scalar(key: str, value: Any) -> float | int:
    """Turn a Python number, numpy scalar or 0-d tensor into a JSON-able number."""
    if getattr(value, "ndim", 0) > 0:
        raise TypeError(f"metric {key!r} must be a scalar, got shape {tuple(value.shape)}")
    if hasattr(value, "item"):
        value = value.item()  # torch / numpy 0-d values
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"metric {key!r} must be a scalar number or 0-d tensor, got {type(value).__name__}")


def wandb_error(err: Exception) -> ConfigError:
    """W&B refused to start (no network, a bad key): one line naming the flag and the way out."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return ConfigError(
        f"--use_wandb: W&B could not start ({type(err).__name__}: {first}); check the network and the "
        "API key, or log offline with --use_wandb offline (wandb sync uploads later)"
    )


class MetricsLogger:
    """Fan-out metric logger; use as a context manager or call ``close()``.

    resume_step: ``None`` starts a fresh run (a new ``metrics.jsonl`` and W&B run); an int
    continues the run stored in ``run_dir``, dropping everything logged after that step.
    """

    def __init__(
        self,
        run_dir: Path | str,
        cfg: LoggingConfig,
        run_config: dict | None = None,
        is_main: bool = True,
        resume_step: int | None = None,
    ) -> None:
        self.run_dir, self.cfg, self.is_main = Path(run_dir), cfg, is_main
        self.metrics_path = self.run_dir / METRICS_FILE
        self._file = self._tb = self._wandb = None
        self._wandb_prefixes: set[str] = set()
        self.run_name = cfg.wandb_run_name
        if not is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        state = self._load_state() if resume_step is not None else {}
        self.run_name = cfg.wandb_run_name or state.get("run_name") or default_run_name()
        self._start_jsonl(resume_step)
        if cfg.use_tensorboard:
            self._tb = self._open_tensorboard(resume_step)
        wandb_id = state.get("wandb_run_id") or uuid.uuid4().hex[:8]
        if cfg.wandb_enabled:
            self._wandb = self._open_wandb(wandb_id, run_config, resume_step is not None)
        self._save_state({"run_name": self.run_name, "wandb_run_id": wandb_id})

    # ---- sinks -------------------------------------------------------------------------------
    def _start_jsonl(self, resume_step: int | None) -> None:
        if resume_step is None:
            if self.metrics_path.exists() and self.metrics_path.stat().st_size:
                log.info("fresh run: replacing %s", self.metrics_path)
            self.metrics_path.write_text("")
        else:
            self.truncate_after(resume_step)
        # Kept open for the logger's lifetime (closed in close()); line buffering puts every
        # record on disk even if training crashes later.
        self._file = open(self.metrics_path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    def _open_tensorboard(self, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        log_dir = Path(self.cfg.use_tensorboard) / self.run_name
        # purge_step makes TensorBoard hide events at or after it from the earlier, crashed run.
        purge = None if resume_step is None else resume_step + 1
        return SummaryWriter(log_dir=str(log_dir), purge_step=purge)

    def _open_wandb(self, run_id: str, run_config: dict | None, resume: bool):
        import wandb

        mode = self.cfg.wandb_mode()
        try:
            if self.cfg.wandb_key and mode not in ("offline", "disabled"):
                wandb.login(key=self.cfg.wandb_key)
            return wandb.init(
                entity=self.cfg.wandb_org,
                project=self.cfg.wandb_project,
                group=self.cfg.wandb_group,
                name=self.run_name,
                id=run_id,
                resume="allow" if resume else None,
                dir=str(self.run_dir),
                config=run_config,
                mode=mode,
            )
        except (wandb.errors.Error, OSError) as err:  # no network, a bad key: before any training
            raise wandb_error(err) from err

    def _wandb_log(self, step: int, record: dict, prefix: str) -> None:
        # A per-prefix step metric (as OpenRLHF does) lets train/eval rows arrive in any order;
        # W&B's own `step=` must be strictly increasing and silently drops late rows.
        step_key = f"{prefix}/global_step" if prefix else "global_step"
        if prefix not in self._wandb_prefixes:
            self._wandb.define_metric(step_key)
            self._wandb.define_metric(f"{prefix}/*" if prefix else "*", step_metric=step_key, step_sync=True)
            self._wandb_prefixes.add(prefix)
        self._wandb.log({step_key: step, **record})

    # ---- public API --------------------------------------------------------------------------
    def log(self, step: int, metrics: dict[str, Any], prefix: str = "train") -> None:
        """Record ``metrics`` at ``step`` under ``<prefix>/<key>`` in every enabled sink."""
        if not self.is_main or self._file is None:
            return
        record = {(f"{prefix}/{k}" if prefix else k): to_scalar(k, v) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": int(step), "time": time.time(), **record}) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                self._tb.add_scalar(key, value, global_step=int(step))
        if self._wandb is not None:
            self._wandb_log(int(step), record, prefix)

    def truncate_after(self, step: int) -> int:
        """Drop JSONL entries with ``"step" > step`` (and a torn last line); return how many dropped."""
        if not self.is_main or not self.metrics_path.exists():
            return 0
        lines = self.metrics_path.read_text(encoding="utf-8").splitlines()
        kept = [line for line in lines if _step_of(line) <= step]
        tmp = self.metrics_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, self.metrics_path)  # atomic: a crash here never leaves a half file
        return len(lines) - len(kept)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
            _wait_for_wandb_files()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- run state ---------------------------------------------------------------------------
    def _load_state(self) -> dict:
        path = self.run_dir / STATE_FILE
        return json.loads(path.read_text()) if path.exists() else {}

    def _save_state(self, state: dict) -> None:
        (self.run_dir / STATE_FILE).write_text(json.dumps(state, indent=1) + "\n")


def _wait_for_wandb_files() -> None:
    """Return only once W&B's service process has written and closed the run's files.

    ``run.finish()`` returns when the run's exit record is processed, but the service closes the
    transaction log (``run-<id>.wandb``) only on a later, fire-and-forget "finish" message; until then
    its LevelDB-log writer keeps the last partial 32 KiB block in memory, so a short run's file can
    still be a bare 7-byte header when ``finish()`` returns (and a reader, or ``wandb sync`` started
    right after, sees no rows). ``wandb.teardown()`` is W&B's way to wait: it asks the service it
    started to close every stream and waits for the process to exit (the next run starts a new one).
    Skipped while another W&B run of this process is still active, as teardown would finish it too.
    """
    import wandb

    if wandb.run is None:
        wandb.teardown()


def _step_of(line: str) -> float:
    """The step of a JSONL line; +inf for a torn/blank line (e.g. a crash mid-write) so it is dropped."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return float("inf")
