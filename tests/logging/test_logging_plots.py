"""plot_metrics writes a real PNG from metrics.jsonl and fails clearly without data."""

import pytest

from tidal.logging import LoggingConfig, MetricsLogger, plot_metrics, read_metrics
from tidal.logging.plots import moving_average

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def jsonl(tmp_path):
    with MetricsLogger(tmp_path, LoggingConfig()) as logger:
        for step in range(1, 21):
            logger.log(step, {"loss": 1.0 / step, "reward": step % 3})
            if step % 5 == 0:
                logger.log(step, {"acc": step / 20}, prefix="eval")
    return tmp_path / "metrics.jsonl"


def test_plot_writes_png(jsonl, tmp_path):
    out = plot_metrics(
        jsonl, tmp_path / "plots" / "curves.png", ["train/loss", "eval/acc"], title="demo", smooth=4
    )
    data = out.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 10_000


def test_missing_keys_warn_and_none_found_errors(jsonl, tmp_path):
    with pytest.warns(UserWarning, match="train/nope"):
        plot_metrics(jsonl, tmp_path / "a.png", ["train/loss", "train/nope"])
    with pytest.raises(ValueError, match="none of the keys"):
        plot_metrics(jsonl, tmp_path / "b.png", ["train/nope"])
    assert not (tmp_path / "b.png").exists()


def test_read_metrics_skips_torn_line(jsonl):
    with open(jsonl, "a") as f:
        f.write('{"step": 21, "tr')
    recs = read_metrics(jsonl)
    assert len(recs) == 24 and recs[-1]["step"] == 20


def test_moving_average():
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
