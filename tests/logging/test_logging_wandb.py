"""W&B sink in offline mode: the run is written under run_dir, values are recorded, resume reuses the id."""

import contextlib
import json
import os
import signal
import struct
import threading

import pytest

from tidal.logging import LoggingConfig, MetricsLogger

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402
from wandb.sdk.lib.service import service_connection  # noqa: E402

BLOCK, HEADER = 32768, 7  # LevelDB log format, which W&B's transaction log (.wandb) uses


def wandb_records(path):
    """Decode the protobuf records of a ``run-<id>.wandb`` file (LevelDB log: 32 KiB blocks)."""
    data, pos, chunk, out = path.read_bytes(), HEADER, b"", []
    assert data[:4] == b":W&B"
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # block trailer padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunk += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):  # FULL or LAST fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            out.append(record)
            chunk = b""
    return out


def logged_history(run_file):
    rows = []
    for rec in wandb_records(run_file):
        if rec.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in rec.history.item
                }
            )
    return rows


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.setenv("WANDB_SILENT", "true")


def run_files(run_dir):
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def test_offline_run_records_values_and_resume_reuses_id(offline, tmp_path):
    run_dir, cfg = tmp_path / "run", LoggingConfig(use_wandb="offline", wandb_run_name="demo")
    with MetricsLogger(run_dir, cfg, run_config={"lr": 1e-5}) as logger:
        logger.log(1, {"loss": 0.5})
        logger.log(2, {"loss": 0.25})
        logger.log(2, {"acc": 0.75}, prefix="eval")
    (first,) = run_files(run_dir)
    run_id = json.loads((run_dir / "logging_state.json").read_text())["wandb_run_id"]
    assert first.name == f"run-{run_id}.wandb"
    rows = logged_history(first)
    assert [(r["train/global_step"], r["train/loss"]) for r in rows if "train/loss" in r] == [
        (1, 0.5),
        (2, 0.25),
    ]
    assert [(r["eval/global_step"], r["eval/acc"]) for r in rows if "eval/acc" in r] == [(2, 0.75)]

    with MetricsLogger(run_dir, cfg, resume_step=2) as logger:
        logger.log(3, {"loss": 0.125})
    files = run_files(run_dir)
    assert len(files) == 2 and all(f.name == f"run-{run_id}.wandb" for f in files)
    second = next(f for f in files if f != first)
    assert [r["train/loss"] for r in logged_history(second) if "train/loss" in r] == [0.125]


@pytest.fixture
def slow_service(monkeypatch):
    """Freeze W&B's service process from the moment ``run.finish()`` sends its last message
    (``inform_finish``, which makes the service close the ``.wandb`` file) until 0.5 s later: a busy
    machine, where the flaky failure read a file holding only its 7-byte header."""
    frozen, original = [], service_connection.ServiceConnection.inform_finish

    def inform_finish_then_stall(self, run_id):
        pid = self._proc._process.pid
        os.kill(pid, signal.SIGSTOP)
        frozen.append(pid)
        original(self, run_id)
        threading.Timer(0.5, os.kill, (pid, signal.SIGCONT)).start()

    monkeypatch.setattr(service_connection.ServiceConnection, "inform_finish", inform_finish_then_stall)
    yield frozen
    for pid in frozen:  # never leave a stopped process behind, whatever happened
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def test_close_returns_only_after_the_run_file_is_written(offline, slow_service, tmp_path):
    run_dir = tmp_path / "run"
    with MetricsLogger(run_dir, LoggingConfig(use_wandb="offline")) as logger:
        logger.log(1, {"loss": 0.5})
    assert slow_service, "the service was not stalled, so this test proved nothing"
    (run_file,) = run_files(run_dir)
    assert [r["train/loss"] for r in logged_history(run_file) if "train/loss" in r] == [0.5]


def test_api_key_is_not_sent_when_offline(offline, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(wandb, "login", lambda **kw: calls.append(kw))
    with MetricsLogger(tmp_path / "run", LoggingConfig(use_wandb="0123456789abcdef")) as logger:
        logger.log(1, {"loss": 1.0})
    assert calls == [] and run_files(tmp_path / "run")


def test_use_wandb_flag_values():
    assert not LoggingConfig().wandb_enabled
    assert not LoggingConfig(use_wandb="False").wandb_enabled
    assert LoggingConfig(use_wandb="True").wandb_enabled and LoggingConfig(use_wandb="True").wandb_key is None
    assert LoggingConfig(use_wandb="abc123").wandb_key == "abc123"


class FakeRun:
    def __init__(self, **kwargs):
        self.kwargs, self.rows = kwargs, []

    def define_metric(self, *args, **kwargs):
        pass

    def log(self, row):
        self.rows.append(row)

    def finish(self):
        pass


def test_api_key_logs_in_when_online(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    logins, runs = [], []
    monkeypatch.setattr(wandb, "login", lambda **kw: logins.append(kw))
    monkeypatch.setattr(wandb, "init", lambda **kw: runs.append(FakeRun(**kw)) or runs[-1])
    cfg = LoggingConfig(use_wandb="0123456789abcdef", wandb_org="org", wandb_group="g", wandb_run_name="r")
    with MetricsLogger(tmp_path, cfg, run_config={"seed": 1}) as logger:
        logger.log(5, {"loss": 2.0})
    assert logins == [{"key": "0123456789abcdef"}]
    kw = runs[0].kwargs
    assert (kw["entity"], kw["group"], kw["name"], kw["project"], kw["mode"]) == (
        "org",
        "g",
        "r",
        "tidal",
        None,
    )
    assert kw["config"] == {"seed": 1} and kw["dir"] == str(tmp_path)
    assert runs[0].rows == [{"train/global_step": 5, "train/loss": 2.0}]


def test_wandb_mode_respects_environment(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert LoggingConfig(use_wandb="offline").wandb_mode() == "offline"
    assert LoggingConfig(use_wandb="True").wandb_mode() is None
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert LoggingConfig(use_wandb="offline").wandb_mode() == "disabled"
