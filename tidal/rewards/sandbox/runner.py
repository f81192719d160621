"""Running samples: one sandbox per sample, its output read with a cap, killed at the deadline, scored.

Nothing raises into the caller for what the code does: every failure is a ``SandboxResult`` with a
status and a one-line message. What does raise: malformed tests or limits (``ValueError``) and a
missing or refused bubblewrap (``SandboxUnavailable``), both before any code runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from tidal.rewards.sandbox import cgroup, isolation, seccomp
from tidal.rewards.sandbox.config import SandboxLimits, SandboxResult, TestCase
from tidal.rewards.sandbox.verdict import Spec, build_spec, one_line, parse_events, verdict

RESULTS_CAP_FACTOR = 4  # the harness's reports may hold this many times max_output_bytes


def run_tests(
    code: str, tests: Sequence[TestCase] | str, limits: SandboxLimits | None = None, **overrides
) -> SandboxResult:
    """Run ``code`` against ``tests`` in a sandbox; never raises for what the code does.

    ``overrides`` replace fields of ``limits`` (``run_tests(code, tests, timeout_s=2)``)."""
    limits = dataclasses.replace(limits or SandboxLimits(), **overrides)
    spec = build_spec(tests)
    prepare(limits)
    try:
        return _run_child(code, spec, limits)
    except Exception as err:  # the sandbox itself failed (no memfd, no fork...): score 0, keep training
        return SandboxResult(0, spec.total, "sandbox_error", one_line(f"{type(err).__name__}: {err}"))


def run_many(
    samples: Sequence[tuple[str, Sequence[TestCase] | str]],
    limits: SandboxLimits | None = None,
    concurrency: int | None = None,
) -> list[SandboxResult]:
    """``run_tests`` over ``(code, tests)`` pairs, at most ``concurrency`` sandboxes at once (default: the
    number of CPUs), results in input order."""
    limits = limits or SandboxLimits()
    workers = concurrency or os.cpu_count() or 1
    if workers < 1:
        raise ValueError(f"sandbox concurrency={concurrency!r}; expected a positive number")
    for _, tests in samples:  # malformed tests fail here, before anything runs
        build_spec(tests)
    if not samples:
        return []
    prepare(limits)
    with ThreadPoolExecutor(max_workers=min(workers, len(samples)), thread_name_prefix="sandbox") as pool:
        return list(pool.map(lambda sample: run_tests(sample[0], sample[1], limits), samples))


def prepare(limits: SandboxLimits) -> None:
    """Refuse (``SandboxUnavailable``) or warn before the first sample, per the isolation asked for."""
    if limits.isolation == "bwrap":
        isolation.check_bwrap()
    else:
        isolation.warn_no_isolation()


def _run_child(code: str, spec: Spec, limits: SandboxLimits) -> SandboxResult:
    job = {"code": code, "tests": spec.job, "limits": dataclasses.asdict(limits)}
    job_fd = os.memfd_create("tidal-sandbox-job")
    read_fd, write_fd = os.pipe()
    fds = [job_fd, write_fd]
    proc = group = scratch = None
    try:
        os.write(job_fd, json.dumps(job).encode())
        os.lseek(job_fd, 0, os.SEEK_SET)
        if limits.isolation == "bwrap":
            seccomp_fd = seccomp.program_fd()
            fds += [seccomp_fd] if seccomp_fd is not None else []
            command = isolation.bwrap_command(limits, job_fd, write_fd, seccomp_fd)
            cwd, env, processes = (
                "/",
                {"PATH": "/usr/bin:/bin"},
                limits.max_processes + isolation.BWRAP_PROCESSES,
            )
        else:
            scratch = tempfile.mkdtemp(prefix="tidal-sandbox-")
            command = isolation.inner_argv(isolation.HARNESS, job_fd, write_fd)
            cwd, env, processes = scratch, isolation.child_env(scratch), limits.max_processes
        group = cgroup.new_pids_cgroup(processes)
        if group is not None:
            command = cgroup.join_then_exec(group, command)
        proc = subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            pass_fds=tuple(fds),
            start_new_session=True,
        )
        for fd in fds:
            os.close(fd)
        fds = []
        output, events, ended = _collect(proc, read_fd, limits)
        _kill_session(proc)
        return verdict(spec, output, events, ended, proc.returncode, limits)
    finally:
        for fd in fds:
            os.close(fd)
        os.close(read_fd)
        if proc is not None:
            _kill_session(proc)
            proc.stdout.close()
        if group is not None:
            cgroup.remove_cgroup(group)
        if scratch is not None:
            _remove_tree(scratch)


def _collect(proc: subprocess.Popen, result_fd: int, limits: SandboxLimits) -> tuple[bytes, list[dict], str]:
    """Read output (capped) and harness reports until both pipes close, the deadline or the output cap.

    Returns (output head, reports, how it ended: "exited" | "timeout" | "output_limit")."""
    deadline = time.monotonic() + limits.timeout_s
    # the reports carry each stdin/stdout case's output (each up to max_output_bytes), JSON-escaped
    results_cap = RESULTS_CAP_FACTOR * limits.max_output_bytes
    output, results = bytearray(), bytearray()
    ended = "exited"
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout.fileno(), selectors.EVENT_READ, "output")
        sel.register(result_fd, selectors.EVENT_READ, "results")
        while sel.get_map() and ended == "exited":
            left = deadline - time.monotonic()
            if left <= 0:
                ended = "timeout"
                break
            for key, _ in sel.select(timeout=left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buffer = output if key.data == "output" else results
                buffer += chunk
                if len(buffer) > (limits.max_output_bytes if buffer is output else results_cap):
                    ended = "output_limit"
                    break
    if ended != "exited":
        _kill_session(proc)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        proc.wait()
    return bytes(output[: limits.max_output_bytes]), parse_events(bytes(results)), ended


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group, then anything else still in its session. Under bwrap that
    is bwrap itself: its PID-1 child dies with it (``--die-with-parent``) and takes the whole PID
    namespace along."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in _session_members(proc.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _session_members(sid: int) -> list[int]:
    """Live processes whose session id is ``sid`` (from /proc; empty where /proc is absent)."""
    members = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # after "(comm)": state ppid pgrp session ...; zombies are already dead.
        if len(fields) > 3 and fields[0] != "Z" and int(fields[3]) == sid:
            members.append(int(entry))
    return members


def _remove_tree(path: str) -> None:
    def make_writable_and_retry(func, target, _exc):
        # the code may have chmod-ed its own files read-only; it owns them, so restore and retry once.
        try:
            os.chmod(os.path.dirname(target), 0o700)
            os.chmod(target, 0o700)
            func(target)
        except OSError:
            pass

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=make_writable_and_retry)
    else:
        shutil.rmtree(path, onerror=make_writable_and_retry)
