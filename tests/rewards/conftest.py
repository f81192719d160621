"""Shared by the code-sandbox tests (test_sandbox.py, test_sandbox_attacks.py): the ``no_sandbox_left``
fixture, which fails a test that leaves a sandbox process alive."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def sandbox_processes() -> set[int]:
    """Live processes of this test process's sandboxes: bwrap, the harness and whatever they forked
    (the harness's command line, which a fork keeps, names harness.py), found by walking each one's
    parents up to this process (another pytest worker's sandboxes are not ours)."""
    parents, found = {}, set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents[int(entry)] = int(fields[1])
        if fields[0] != "Z" and (b"harness.py" in cmdline or cmdline.startswith(b"bwrap\0")):
            found.add(int(entry))
    return {pid for pid in found if _descends_from_us(pid, parents)}


def _descends_from_us(pid: int, parents: dict[int, int]) -> bool:
    for _ in range(64):
        pid = parents.get(pid, 0)
        if pid == os.getpid():
            return True
        if pid <= 1:
            return False
    return False


@pytest.fixture
def no_sandbox_left():
    """No sandbox process is left after the test (use it with ``pytest.mark.usefixtures``)."""
    yield
    assert sandbox_processes() == set()
