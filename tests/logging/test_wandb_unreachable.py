"""A W&B key with no network (or a key W&B refuses) stops the run with one line naming --use_wandb,
not wandb's traceback."""

from __future__ import annotations

import pytest

from tidal.config.args import ConfigError
from tidal.logging import LoggingConfig, MetricsLogger

wandb = pytest.importorskip("wandb")


def test_wandb_login_without_network_is_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # online, so the key is used

    def no_network(**kwargs):
        raise wandb.errors.CommError("Network error (ConnectionError), entering retry loop.\nmore detail")

    monkeypatch.setattr(wandb, "login", no_network)
    cfg = LoggingConfig(use_wandb="0123456789abcdef0123456789abcdef01234567")
    with pytest.raises(ConfigError) as info:
        MetricsLogger(tmp_path / "run", cfg)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("--use_wandb: W&B could not start (CommError: Network error")
    assert "--use_wandb offline" in message
