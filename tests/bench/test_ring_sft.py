"""``bench/ring_sft.py``: the length search (doubling, bisection, the budget stop), the memory
extrapolation, how a failed attempt is classified (out of memory, cut off, any other error), and one real
attempt: a tiny SFT step with ring attention over 2 CPU processes (torchrun, gloo)."""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import ring_sft  # noqa: E402


def walk(fits, start: int, resolution: int, max_len: int, known=None) -> tuple[list[int], dict]:
    """Drive ``next_length`` with the oracle ``fits``: the lengths tried, in order, and what was found."""
    known, tried = dict(known or {}), []
    while (n := ring_sft.next_length(known, start, resolution, max_len)) is not None:
        tried.append(n)
        known[n] = fits(n)
    return tried, known


def test_search_doubles_then_bisects_to_the_resolution():
    tried, known = walk(lambda n: n <= 700, start=64, resolution=64, max_len=4096)
    assert tried == [64, 128, 256, 512, 1024, 768, 640, 704]
    assert ring_sft.longest(known) == 640  # 704 failed: the bounds are one resolution apart


def test_search_starts_below_a_known_fit_and_caps_at_max_len():
    # a measured length seeds the search; the ladder from --start_len skips it; --max_len ends it
    tried, known = walk(lambda n: True, start=8, resolution=8, max_len=100, known={32: True})
    assert tried == [8, 16, 64, 100]
    assert ring_sft.longest(known) == 100


def test_search_when_even_the_start_fails():
    tried, known = walk(lambda n: n <= 100, start=512, resolution=64, max_len=4096)
    assert tried == [512, 256, 128, 64]  # bisection towards 0: 64 fits, 128 does not
    assert ring_sft.longest(known) == 64
    tried, known = walk(lambda n: False, start=64, resolution=64, max_len=4096)
    assert tried == [64] and ring_sft.longest(known) == 0


def test_memory_fits_cross_the_capacity_where_the_polynomial_does():
    linear = [(1000, 10.0 + 0.01 * 1000), (2000, 10.0 + 0.01 * 2000)]
    assert ring_sft.fit_capacity(linear, 30.0, 1) == 2000
    assert ring_sft.fit_capacity(linear, 30.0, 2) is None  # two lengths: no quadratic fit
    quad = [(n, 5.0 + 1e-6 * n * n) for n in (1000, 2000, 4000)]
    assert ring_sft.fit_capacity(quad, 5.0 + 1e-6 * 6000**2, 2) == pytest.approx(6000, abs=1)
    assert ring_sft.fit_capacity([(1000, 5.0), (2000, 5.0)], 80.0, 1) is None  # never reaches it


def fake_launch(fits_up_to: int, step_s):
    """A stand-in for ``launch``: fits up to ``fits_up_to`` tokens, one step taking ``step_s(L)`` seconds."""

    def launch(args, ring, length, warmup, steps, timeout):
        if length > fits_up_to:
            return ring_sft.Attempt(length, False, 1.0)
        times = [step_s(length)] * (warmup + steps)
        result = {"length": length, "ring": ring, "step_s": times, "losses": [6.9] * len(times),
                  "peak_gb": [1.0 + length / 1000] * ring, "device_gb": 11.0, "tokens_per_step": ring * length}  # fmt: skip
        return ring_sft.Attempt(length, True, 1.0 + sum(times), result)

    return launch


def test_search_reports_the_longest_fit_and_extrapolates_memory(monkeypatch):
    monkeypatch.setattr(ring_sft, "launch", fake_launch(5000, lambda n: 0.0))
    args = ring_sft.parse_args(["--start_len", "1024", "--max_len", "65536", "--resolution", "512"])
    entry = ring_sft.search(args, 2, deadline=float("inf"), seeded=[], flops=lambda n: n)
    assert entry["longest_len"] == 4608 and entry["shortest_oom_len"] == 5120
    assert entry["stopped"] == "resolution"
    assert entry["extrapolated_max_len"]["linear"] == 10000  # 1 + L/1000 GB reaches 11 GB there


def test_search_stops_before_an_attempt_the_budget_cannot_hold(monkeypatch):
    # steps take L/1000 s and FLOPs grow like L: 2048 would take ~2 s + 1 s start-up with 2.5 s left
    monkeypatch.setattr(ring_sft, "launch", fake_launch(10**9, lambda n: n / 1000))
    args = ring_sft.parse_args(["--start_len", "1024", "--max_len", "65536", "--resolution", "512"])
    entry = ring_sft.search(args, 1, deadline=time.monotonic() + 2.5, seeded=[], flops=lambda n: n)
    assert entry["longest_len"] == 1024
    assert entry["stopped"].startswith("budget: L=2048 predicted 3 s")


def test_failed_attempts_are_out_of_memory_cut_off_or_errors(tmp_path):
    out = tmp_path / "never_written.json"
    oom = "import sys; sys.stderr.write('torch.OutOfMemoryError: CUDA out of memory\\n'); sys.exit(3)"
    assert ring_sft.run_attempt([sys.executable, "-c", oom], 64, out, timeout=60).fits is False
    error = "import sys; sys.stderr.write('line one\\nValueError: bad shape\\n'); sys.exit(1)"
    with pytest.raises(ring_sft.BenchError, match="exit 1\nline one\nValueError: bad shape"):
        ring_sft.run_attempt([sys.executable, "-c", error], 64, out, timeout=60)
    cut = ring_sft.run_attempt([sys.executable, "-c", "import time; time.sleep(60)"], 64, out, timeout=1)
    assert cut.fits is None and cut.wall_s < 30


def test_one_ring_attempt_trains_a_step_over_two_cpu_processes(tmp_path):
    args = ring_sft.parse_args(["--folder", str(tmp_path)])
    attempt = ring_sft.launch(args, ring=2, length=96, warmup=0, steps=1, timeout=120)
    assert attempt.fits is True
    r = attempt.result
    assert r["ring"] == 2 and r["length"] == 96 and r["tokens_per_step"] == 192
    assert len(r["step_s"]) == 1 and len(r["peak_gb"]) == 2  # one peak per rank (None on the CPU)
    assert 5.0 < r["losses"][0] < 9.0  # about ln(1024): a random-init model on random tokens


def test_an_error_ends_only_that_ring_sizes_part(monkeypatch, capsys):
    fits = fake_launch(300, lambda n: n / 1e6)

    def launch(args, ring, length, warmup, steps, timeout):
        if ring == 2 and length > 256:
            raise ring_sft.BenchError(f"ring 2, length {length}: exit 1\nRuntimeError: NCCL error")
        return fits(args, ring, length, warmup, steps, timeout)

    monkeypatch.setattr(ring_sft, "launch", launch)
    report = ring_sft.main(["--max_len", "1024", "--resolution", "32"])
    assert report["measure"]["1"]["tokens_per_s"] > 0 and report["measure"]["2"]["tokens_per_s"] > 0
    one, two = report["search"]["1"], report["search"]["2"]
    assert one["longest_len"] == 288 and one["stopped"] == "resolution"
    assert two["longest_len"] == 256 and two["stopped"] == "error" and "NCCL error" in two["error"]
    assert report["longest_len_ratio_vs_ring1"] == {"1": 1.0, "2": round(256 / 288, 3)}
    assert '"bench": "ring_sft"' in capsys.readouterr().out  # the one JSON line


def test_stderr_is_scanned_for_step_times_and_out_of_memory(capsys):
    text = ring_sft.step_line(2, 4096, 0, 1.5) + "\nnoise\n" + ring_sft.step_line(2, 4096, 1, 0.25) + "\n"
    tail = ring_sft.StderrTail(io.StringIO(text + "torch.OutOfMemoryError: CUDA out of memory.\n"))
    tail.close()
    assert tail.step_times == [1.5, 0.25] and tail.oom
    assert capsys.readouterr().err.count("step") == 2  # the progress lines are passed on, the rest kept
    assert tail.tail().endswith("CUDA out of memory.")


def test_a_cut_off_measurement_reports_the_steps_it_finished(monkeypatch):
    def launch(args, ring, length, warmup, steps, timeout):
        return ring_sft.Attempt(length, None, 99.0, steps_seen=[30.0, 20.0])  # warm-up + one timed step

    monkeypatch.setattr(ring_sft, "launch", launch)
    args = ring_sft.parse_args(["--measure_len", "256", "--steps", "2"])
    entry, _ = ring_sft.measure(args, 2, deadline=time.monotonic() + 60)
    assert entry["stopped"] == "budget" and entry["step_s"] == 20.0 and entry["steps_timed"] == 1
    assert entry["tokens_per_s"] == round(2 * 256 / 20.0) and not entry["warmup_included"]


def test_no_attempt_once_the_share_is_spent(monkeypatch):
    monkeypatch.setattr(ring_sft, "launch", lambda *a, **k: pytest.fail("launched past the deadline"))
    args = ring_sft.parse_args([])
    entry = ring_sft.search(args, 2, deadline=time.monotonic() - 1, seeded=[], flops=lambda n: n)
    assert entry["longest_len"] == 0 and entry["stopped"].startswith("budget: L=256 predicted None s")
