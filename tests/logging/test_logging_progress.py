"""ProgressBar postfix formatting and sliding-window Throughput (fake clock, no timing)."""

import pytest
import torch

from tidal.logging import ProgressBar, Throughput
from tidal.logging import progress as progress_module
from tidal.logging.progress import format_value


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(progress_module, "perf_counter", fake)
    return fake


def test_throughput_over_sliding_window(clock):
    meter = Throughput(window=2)
    assert meter.rate == 0.0
    clock.now += 1.0
    assert meter.update(100) == pytest.approx(100.0)
    clock.now += 1.0
    assert meter.update(300) == pytest.approx(200.0)  # 400 tokens over 2 s
    clock.now += 2.0
    # window=2: only the last two updates count (300 + 100 tokens over 3 s), not the first second
    assert meter.update(100) == pytest.approx(400 / 3)


def test_throughput_reset_restarts_window(clock):
    meter = Throughput()
    clock.now += 1.0
    meter.update(50)
    clock.now += 10.0  # e.g. an evaluation pause
    meter.reset()
    clock.now += 0.5
    assert meter.update(50) == pytest.approx(100.0)


def test_format_value_is_compact():
    assert format_value("lr", 3e-6) == "3.00e-06"
    assert format_value("actor_lr", torch.tensor(1e-4)) == "1.00e-04"
    assert format_value("loss", torch.tensor(0.123456)) == "0.1235"
    assert format_value("tokens_per_s", 12345.6) == "12.3k"
    assert format_value("tokens", 2_500_000) == "2.50M"
    assert format_value("step", 7) == "7"


def test_progress_bar_shows_postfix(capsys):
    with ProgressBar(total=4, initial=1, desc="train") as bar:
        bar.update(1, loss=torch.tensor(0.5), lr=1e-5, tokens_per_s=20000.0)
        bar.update(2)
        assert bar.n == 4
    err = capsys.readouterr().err
    assert "train" in err and "4/4" in err
    assert "loss=0.5" in err and "lr=1.00e-05" in err and "tokens_per_s=20.0k" in err


def test_progress_bar_hidden_off_main_rank(capsys):
    with ProgressBar(total=3, is_main=False) as bar:
        bar.update(3, loss=1.0)
    assert capsys.readouterr().err == ""
