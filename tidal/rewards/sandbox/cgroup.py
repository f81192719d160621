"""A pids cgroup per sample, when the trainer is root: bounds the number of processes even for code that
forks through libc, and lets the trainer kill every process of the sample. It is created and joined
outside the sandbox, where the code cannot see it (no cgroup filesystem is mounted inside)."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time


def pids_cgroup_parent() -> str | None:
    """A folder where a root process may create pids cgroups: the v1 ``pids`` hierarchy, or this
    process's v2 cgroup when it delegates ``pids`` to children. None when not root or not possible."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return None
    return _probe_pids_cgroup()


@functools.cache
def _probe_pids_cgroup() -> str | None:
    candidates = ["/sys/fs/cgroup/pids"]
    with contextlib.suppress(OSError):
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            v2 = [line.split(":", 2)[2].strip() for line in f if line.startswith("0::")]
        if v2:
            candidates.append("/sys/fs/cgroup" + v2[0].rstrip("/"))
    for parent in candidates:
        probe = os.path.join(parent, f"tidal-sandbox-probe-{os.getpid()}")
        try:
            os.mkdir(probe)
        except OSError:
            continue
        try:
            with open(os.path.join(probe, "pids.max"), "w", encoding="utf-8") as f:
                f.write("1")
            return parent
        except OSError:
            continue
        finally:
            with contextlib.suppress(OSError):
                os.rmdir(probe)
    return None


_COUNT = iter(range(1 << 62))


def new_pids_cgroup(max_processes: int) -> str | None:
    """A fresh cgroup whose ``pids.max`` is ``max_processes`` (None where pids cgroups are unavailable)."""
    parent = pids_cgroup_parent()
    if parent is None:
        return None
    path = os.path.join(parent, f"tidal-sandbox-{os.getpid()}-{next(_COUNT)}")
    try:
        os.mkdir(path)
        with open(os.path.join(path, "pids.max"), "w", encoding="utf-8") as f:
            f.write(str(max_processes))
    except OSError:
        with contextlib.suppress(OSError):
            os.rmdir(path)
        return None
    return path


def join_then_exec(cgroup: str, command: list[str]) -> list[str]:
    """``command`` behind a shell that joins ``cgroup`` first: no process of the sample starts outside it."""
    return ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', cgroup, *command]


def remove_cgroup(path: str, attempts: int = 250) -> None:
    """SIGKILL every process left in the sample's cgroup, then remove it (a cgroup must be empty)."""
    for attempt in range(attempts):
        try:
            with open(os.path.join(path, "cgroup.procs"), encoding="utf-8") as f:
                pids = [int(line) for line in f if line.strip()]
        except OSError:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        try:
            os.rmdir(path)
            return
        except OSError:
            # busy until the last exited process has been released (an RCU grace period after its
            # reaping, usually a few ms): poll fast first, then every 20 ms
            time.sleep(min(0.001 * 2**attempt, 0.02))
