"""Configuration of the metric sinks: JSONL (always), TensorBoard and Weights & Biases (optional).

Field names follow the seed CLI (``--logging_steps``, ``--use_wandb``, ``--wandb_org``,
``--wandb_group``, ``--wandb_project``, ``--wandb_run_name``, ``--use_tensorboard``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime

from tidal.config.args import ConfigError, arg

# ``--use_wandb`` values that switch W&B on without a key (an existing login, WANDB_API_KEY or
# offline mode supplies the credentials); anything else that is not "off" is taken as an API key.
WANDB_FLAG_VALUES = frozenset({"true", "1", "yes", "offline"})
WANDB_OFF_VALUES = frozenset({"", "false", "0", "no", "none"})


@dataclass
class LoggingConfig:
    """Where and how often metrics go.

    use_wandb: the seed's ``--use_wandb {token}``. ``None``/"False"/"0" disables W&B. "True"/"1"
        logs with the credentials W&B already has (``wandb login``, ``WANDB_API_KEY``); "offline"
        logs offline (``wandb sync`` uploads later). Any other value is an API key passed to
        ``wandb.login(key=...)``, skipped when ``WANDB_MODE`` is offline/disabled, which is
        always respected (set ``WANDB_MODE=offline`` on machines without network).
    wandb_run_name: also names the TensorBoard sub-directory; ``None`` reuses the name stored by
        an earlier run in the same run directory when resuming, else ``exp_<timestamp>``.
    use_tensorboard: a log directory; events go to ``<use_tensorboard>/<run name>``.
    """

    logging_steps: int = arg(1, help="log training metrics every N steps")
    use_wandb: str | None = arg(None, help="Weights & Biases: an API key, True (existing login) or offline")
    wandb_org: str | None = arg(None, help="W&B entity (team or user)")
    wandb_group: str | None = arg(None, help="W&B run group")
    wandb_project: str = arg("tidal", help="W&B project")
    wandb_run_name: str | None = arg(
        None, help="run name (W&B and the TensorBoard sub-folder); default exp_<time>"
    )
    use_tensorboard: str | None = arg(None, help="TensorBoard log directory")

    def __post_init__(self) -> None:
        if self.logging_steps < 1:
            raise ConfigError(f"--logging_steps must be >= 1, got {self.logging_steps}")

    @property
    def wandb_enabled(self) -> bool:
        return self.use_wandb is not None and str(self.use_wandb).strip().lower() not in WANDB_OFF_VALUES

    @property
    def wandb_key(self) -> str | None:
        """The API key in ``use_wandb``, or None when it is a plain on/offline flag."""
        if not self.wandb_enabled or str(self.use_wandb).strip().lower() in WANDB_FLAG_VALUES:
            return None
        return str(self.use_wandb).strip()

    def wandb_mode(self) -> str | None:
        """The W&B mode to request: WANDB_MODE wins, then "offline" from the flag, else W&B's default."""
        if os.environ.get("WANDB_MODE"):
            return os.environ["WANDB_MODE"]
        return "offline" if str(self.use_wandb).strip().lower() == "offline" else None

    def should_log(self, step: int) -> bool:
        """True on steps that are multiples of ``logging_steps``."""
        return step % self.logging_steps == 0


def default_run_name() -> str:
    return "exp_" + datetime.now().strftime("%Y%m%d_%H%M%S")
