"""Run model-written Python against test cases in a separate, limited process (code rewards).

    from tidal.rewards.sandbox import TestCase, run_tests, run_many
    run_tests("def add(a, b):\\n    return a + b", "assert add(1, 2) == 3\\nassert add(2, 2) == 5")
    # SandboxResult(passed=1, total=2, status='failed', message='test 2: AssertionError ...')
    run_tests("print(sum(map(int, input().split())))", [TestCase("1 2\\n", "3\\n")], timeout_s=2)

Tests are either a string of ``assert`` statements (HumanEval/MBPP style: each top-level ``assert`` is
one test, other statements are setup run in order) or ``TestCase(stdin, stdout)`` pairs (the program
runs once per case as ``__main__`` with that stdin; its stdout must match up to trailing whitespace).

What is enforced, and where (docs/recipes.md, "Code rewards in a sandbox", says the same):

- trainer side: the code never runs in the trainer's process. Each sample gets a child process in a
  new session (its own process group), a fresh scratch directory as cwd/HOME/TMPDIR (deleted after),
  a minimal environment, a wall-clock timeout after which the whole process group is SIGKILLed,
  stdout+stderr read with a hard byte cap (over it: killed, ``output_limit``), and a final sweep that
  kills any process still in the child's session. Nothing raises into the caller: every failure is a
  ``SandboxResult`` with a status and a one-line message.
- kernel side, in the child before the code runs (``resource.setrlimit``): CPU seconds, address space
  (``memory_mb``), processes (RLIMIT_NPROC; Linux does not apply it to root), file size, open files,
  no core files. Running as root, where a pids cgroup can be created (cgroup v1 ``pids`` controller or
  v2 with ``pids`` enabled; probed once), each sample also gets a cgroup of its own whose ``pids.max``
  is ``max_processes``: that bounds a fork bomb that calls libc through ``ctypes`` even for root, and
  the final sweep kills every process listed in it.
- namespaces, where ``unshare --user --net --pid`` works (probed once; ``namespaces="on"/"off"/"auto"``):
  no network interfaces at all, and every process of the sample dies with the namespace's first process.
- Python side, an audit hook installed before the code runs: network (connect, bind, sendto, DNS),
  process creation (fork, exec, spawn, subprocess, os.system), signals to other processes, changing
  limits, and writing, removing or renaming files outside the scratch directory are refused; an attempt
  is reported (``forbidden``, score 0) even when the code catches the ``PermissionError``. Audit hooks
  stop honest mistakes and naive attacks, not code that calls libc through ``ctypes``; the layers above
  bound that. Code also shares the harness's interpreter, so adversarial code can fake its own results:
  this protects the trainer, it does not prove a reward was earned.

This file runs as the child's harness too (``python -I sandbox.py JOB``), so it imports only the standard
library.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import errno
import functools
import json
import math
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

# Statuses that score by fraction passed; every other status scores 0.
SCORED_STATUSES = ("passed", "failed")
STATUSES = SCORED_STATUSES + (
    "no_code",
    "syntax_error",
    "error",
    "timeout",
    "memory",
    "output_limit",
    "file_limit",
    "forbidden",
    "crashed",
    "sandbox_error",
)
_NAMESPACE_PREFIX = ("unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child")
_MESSAGE_CHARS = 300


@dataclass(frozen=True)
class TestCase:
    """One stdin -> stdout test: the program's output must equal ``stdout`` up to trailing whitespace."""

    __test__ = False  # not a pytest test class

    stdin: str = ""
    stdout: str = ""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sample's process. ``cpu_s`` defaults to the wall timeout rounded up."""

    timeout_s: float = 10.0
    memory_mb: int = 1024
    max_output_bytes: int = 1 << 20
    cpu_s: int | None = None
    max_processes: int = 16
    max_file_mb: int = 16
    max_open_files: int = 64
    namespaces: str = "auto"

    def __post_init__(self) -> None:
        for name in (
            "timeout_s",
            "memory_mb",
            "max_output_bytes",
            "max_processes",
            "max_file_mb",
            "max_open_files",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox limit {name}={getattr(self, name)!r}; expected a positive number")
        if self.cpu_s is not None and self.cpu_s <= 0:
            raise ValueError(f"sandbox limit cpu_s={self.cpu_s!r}; expected a positive number or None")
        if self.namespaces not in ("auto", "on", "off"):
            raise ValueError(f"sandbox namespaces={self.namespaces!r}; expected 'auto', 'on' or 'off'")


@dataclass(frozen=True)
class SandboxResult:
    """``passed`` of ``total`` tests, a ``status`` from ``STATUSES`` and a one-line ``message``."""

    passed: int
    total: int
    status: str
    message: str = ""

    @property
    def score(self) -> float:
        """Fraction of tests passed; 0 for every failure of the sample as a whole (timeout, crash...)."""
        if self.status not in SCORED_STATUSES or self.total == 0:
            return 0.0
        return self.passed / self.total


# ----------------------------------------------------------------------------------------------------
# Trainer side
# ----------------------------------------------------------------------------------------------------


def run_tests(
    code: str, tests: Sequence[TestCase] | str, limits: SandboxLimits | None = None, **overrides
) -> SandboxResult:
    """Run ``code`` against ``tests`` in a sandboxed child process; never raises for what the code does.

    ``overrides`` replace fields of ``limits`` (``run_tests(code, tests, timeout_s=2)``). Malformed
    ``tests`` or limits raise ``ValueError`` (a data/config error, not the model's fault)."""
    limits = dataclasses.replace(limits or SandboxLimits(), **overrides)
    spec = _test_spec(tests)
    use_namespaces = _want_namespaces(limits.namespaces)
    try:
        return _run_child(code, spec, limits, use_namespaces)
    except Exception as err:  # the sandbox itself failed (no temp dir, no fork...): score 0, keep training
        return SandboxResult(0, spec["total"], "sandbox_error", _one_line(f"{type(err).__name__}: {err}"))


def run_many(
    samples: Sequence[tuple[str, Sequence[TestCase] | str]],
    limits: SandboxLimits | None = None,
    concurrency: int | None = None,
) -> list[SandboxResult]:
    """``run_tests`` over ``(code, tests)`` pairs, at most ``concurrency`` children at once (default: the
    number of CPUs), results in input order."""
    limits = limits or SandboxLimits()
    workers = concurrency or os.cpu_count() or 1
    if workers < 1:
        raise ValueError(f"sandbox concurrency={concurrency!r}; expected a positive number")
    for _, tests in samples:  # malformed tests fail here, before anything runs
        _test_spec(tests)
    if not samples:
        return []
    with ThreadPoolExecutor(max_workers=min(workers, len(samples)), thread_name_prefix="sandbox") as pool:
        return list(pool.map(lambda sample: run_tests(sample[0], sample[1], limits), samples))


_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str | None:
    """The last ```python (or ```py) block of a response; else its last unlabelled ``` block; else None."""
    blocks = _FENCE.findall(response)
    for wanted in (("python", "py", "python3"), ("",)):
        chosen = [body for lang, body in blocks if lang.lower() in wanted]
        if chosen:
            return chosen[-1]
    return None


def parse_tests(label, where: str = "label") -> list[TestCase] | str:
    """Tests from a dataset label: a string of asserts; ``{"inputs": [...], "outputs": [...]}`` (APPS);
    a list of ``{"input": ..., "output": ...}``; or either of those as a JSON string."""
    if isinstance(label, str):
        stripped = label.strip()
        if stripped[:1] in "[{":
            try:
                label = json.loads(stripped)
            except ValueError:
                label = stripped  # e.g. a test file starting with a list literal: treat as Python
        if isinstance(label, str):
            return label
    if isinstance(label, dict) and "inputs" in label and "outputs" in label:
        inputs, outputs = label["inputs"], label["outputs"]
        if isinstance(inputs, list) and isinstance(outputs, list) and len(inputs) == len(outputs) and inputs:
            return [TestCase(_text(i), _text(o)) for i, o in zip(inputs, outputs, strict=True)]
    if (
        isinstance(label, list)
        and label
        and all(isinstance(c, dict) and {"input", "output"} <= set(c) for c in label)
    ):
        return [TestCase(_text(c["input"]), _text(c["output"])) for c in label]
    raise ValueError(
        f"{where} is {_clip(repr(label))}; expected a string of assert statements, "
        '{"inputs": [...], "outputs": [...]} of equal non-zero length, or a list of {"input", "output"}'
    )


def _text(value) -> str:
    return (
        value
        if isinstance(value, str)
        else "\n".join(map(str, value))
        if isinstance(value, list)
        else str(value)
    )


def code_reward(
    queries: Sequence[str],
    prompts: Sequence[str],
    labels: Sequence,
    limits: SandboxLimits | None = None,
    concurrency: int | None = None,
) -> dict:
    """A ``reward_func``: the last ```python block of each response runs against its label's tests;
    reward = fraction passed (0 for no code block and for every failure of the sample as a whole).

    ``extra_logs`` has the mean pass rate and the fraction of samples with each status; a one-line
    summary of the failures (count and first message per status) goes to the ``tidal.rewards.sandbox``
    logger at INFO level."""
    import logging

    samples, results = [], {}
    for i, (query, prompt, label) in enumerate(zip(queries, prompts, labels, strict=True)):
        response = query[len(prompt) :] if query.startswith(prompt) else query
        tests = parse_tests(label, f"label of sample {i}")
        code = extract_code(response)
        if code is None:
            results[i] = SandboxResult(
                0, 1 if isinstance(tests, str) else len(tests), "no_code", "no ``` block"
            )
        else:
            samples.append((i, code, tests))
    ran = run_many([(code, tests) for _, code, tests in samples], limits, concurrency)
    results.update({i: result for (i, _, _), result in zip(samples, ran, strict=True)})
    ordered = [results[i] for i in range(len(queries))]
    rewards = [r.score for r in ordered]
    n = max(len(ordered), 1)
    logs = {"sandbox/pass_rate": sum(rewards) / n}
    logs.update({f"sandbox/{status}": sum(r.status == status for r in ordered) / n for status in STATUSES})
    failures = {}
    for r in ordered:
        if r.status not in SCORED_STATUSES:
            count, message = failures.get(r.status, (0, r.message))
            failures[r.status] = (count + 1, message)
    if failures:
        summary = "; ".join(
            f"{status} x{count} (e.g. {message})" for status, (count, message) in failures.items()
        )
        logging.getLogger(__name__).info("sandbox: %d of %d samples failed: %s", sum(
            c for c, _ in failures.values()), len(ordered), summary)  # fmt: skip
    return {"rewards": rewards, "scores": rewards, "extra_logs": logs}


@functools.cache
def namespaces_available() -> bool:
    """Whether ``unshare --user --net --pid`` works here (unprivileged user namespaces allowed)."""
    if shutil.which("unshare") is None:
        return False
    try:
        done = subprocess.run([*_NAMESPACE_PREFIX, "true"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _want_namespaces(setting: str) -> bool:
    if setting == "off":
        return False
    available = namespaces_available()
    if setting == "on" and not available:
        raise ValueError(
            "sandbox namespaces='on' but `unshare --user --net --pid` does not work here "
            "(util-linux missing or unprivileged user namespaces disabled); use 'auto' or 'off'"
        )
    return available


def _test_spec(tests: Sequence[TestCase] | str) -> dict:
    """The JSON-able form of ``tests`` with the number of tests; ``ValueError`` for malformed tests."""
    if isinstance(tests, str):
        try:
            tree = ast.parse(tests)
        except SyntaxError as err:
            raise ValueError(f"test code does not parse: {err.msg} (line {err.lineno})") from err
        total = sum(isinstance(node, ast.Assert) for node in tree.body)
        return {"kind": "asserts", "source": tests, "total": max(total, 1)}
    cases = list(tests)
    if not cases or not all(isinstance(c, TestCase) for c in cases):
        raise ValueError(
            f"tests are a {type(tests).__name__}; expected a string of assert statements or a non-empty "
            "list of TestCase(stdin, stdout)"
        )
    return {"kind": "io", "cases": [[c.stdin, c.stdout] for c in cases], "total": len(cases)}


def _run_child(code: str, spec: dict, limits: SandboxLimits, use_namespaces: bool) -> SandboxResult:
    scratch = tempfile.mkdtemp(prefix="tidal-sandbox-")
    read_fd, write_fd = os.pipe()
    proc = cgroup = None
    try:
        job = {"code": code, "tests": spec, "limits": dataclasses.asdict(limits), "result_fd": write_fd}
        job_path = os.path.join(scratch, ".job.json")
        with open(job_path, "w", encoding="utf-8") as f:
            json.dump(job, f)
        # -I: no PYTHON* variables, user site or script directory (tidal is not importable); -B: no .pyc.
        command = [sys.executable, "-I", "-B", "-X", "utf8", os.path.abspath(__file__), job_path]
        if use_namespaces:
            command = [*_NAMESPACE_PREFIX, *command]
        cgroup = _new_pids_cgroup(limits.max_processes)
        if cgroup is not None:
            # The shell joins the cgroup, then execs the sandbox: no process of the sample starts outside it.
            command = ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', cgroup, *command]
        proc = subprocess.Popen(
            command,
            cwd=scratch,
            env=_child_env(scratch),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            pass_fds=(write_fd,),
            start_new_session=True,
        )
        os.close(write_fd)
        write_fd = -1
        output, events, ended = _collect(proc, read_fd, limits)
        _kill_session(proc)
        return _verdict(spec["total"], output, events, ended, proc.returncode, limits)
    finally:
        if write_fd >= 0:
            os.close(write_fd)
        os.close(read_fd)
        if proc is not None:
            _kill_session(proc)
            proc.stdout.close()
        if cgroup is not None:
            _remove_cgroup(cgroup)
        _remove_tree(scratch)


def _pids_cgroup_parent() -> str | None:
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


_CGROUP_COUNT = iter(range(1 << 62))


def _new_pids_cgroup(max_processes: int) -> str | None:
    """A fresh cgroup whose ``pids.max`` is ``max_processes`` (None where pids cgroups are unavailable)."""
    parent = _pids_cgroup_parent()
    if parent is None:
        return None
    path = os.path.join(parent, f"tidal-sandbox-{os.getpid()}-{next(_CGROUP_COUNT)}")
    try:
        os.mkdir(path)
        with open(os.path.join(path, "pids.max"), "w", encoding="utf-8") as f:
            f.write(str(max_processes))
    except OSError:
        with contextlib.suppress(OSError):
            os.rmdir(path)
        return None
    return path


def _remove_cgroup(path: str, attempts: int = 50) -> None:
    """SIGKILL every process left in the sample's cgroup, then remove it (a cgroup must be empty)."""
    for _ in range(attempts):
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
            time.sleep(0.02)  # killed processes leave the cgroup once reaped


def _child_env(scratch: str) -> dict[str, str]:
    # One BLAS/OpenMP thread: each thread reserves address space and counts against RLIMIT_NPROC.
    threads = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    return {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8", **threads}


def _collect(proc: subprocess.Popen, result_fd: int, limits: SandboxLimits) -> tuple[bytes, list[dict], str]:
    """Read output (capped) and harness events until both pipes close, the deadline or the output cap.

    Returns (output head, events, how it ended: "exited" | "timeout" | "output_limit")."""
    deadline = time.monotonic() + limits.timeout_s
    output, results = bytearray(), bytearray()
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout.fileno(), selectors.EVENT_READ, "output")
        sel.register(result_fd, selectors.EVENT_READ, "results")
        ended = "exited"
        while sel.get_map():
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
                if len(buffer) > limits.max_output_bytes:
                    ended = "output_limit"
                    break
            if ended != "exited":
                break
    if ended != "exited":
        _kill_session(proc)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        proc.wait()
    return bytes(output[: limits.max_output_bytes]), _parse_events(bytes(results)), ended


def _parse_events(raw: bytes) -> list[dict]:
    events = []
    for line in raw.decode("utf-8", "replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill, or garbage the code wrote on the harness's pipe
        if isinstance(event, dict):
            events.append(event)
    return events


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group, then anything else still in its session (a process that moved
    to a new group); with namespaces the kernel also kills the whole PID namespace."""
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


def _verdict(
    total: int, output: bytes, events: list[dict], ended: str, returncode: int | None, limits: SandboxLimits
) -> SandboxResult:
    """The sample's result from how the child ended and what its harness reported."""
    passed = sum(1 for e in events if e.get("event") == "test" and e.get("ok"))
    failures = [e for e in events if e.get("event") == "test" and not e.get("ok")]
    forbidden = next((e for e in events if e.get("event") == "forbidden"), None)
    fatal = next((e for e in events if e.get("event") == "fatal"), None)
    done = any(e.get("event") == "done" for e in events)
    if forbidden is not None:
        return SandboxResult(passed, total, "forbidden", _one_line(f"refused: {forbidden.get('what')}"))
    if ended == "output_limit":
        return SandboxResult(passed, total, "output_limit", f"output over {limits.max_output_bytes} bytes")
    if ended == "timeout":
        return SandboxResult(
            passed,
            total,
            "timeout",
            f"wall-clock timeout after {limits.timeout_s:g} s ({passed}/{total} passed)",
        )
    if fatal is not None:
        return SandboxResult(passed, total, fatal.get("status", "error"), _one_line(fatal.get("message", "")))
    if not done:
        return SandboxResult(passed, total, *_death(returncode, output, limits))
    if passed == total:
        return SandboxResult(passed, total, "passed", f"{passed}/{total} tests passed")
    first = failures[0].get("message", "") if failures else ""
    return SandboxResult(passed, total, "failed", _one_line(f"{passed}/{total} passed; {first}"))


def _death(returncode: int | None, output: bytes, limits: SandboxLimits) -> tuple[str, str]:
    """(status, message) for a child that ended without its harness saying it was done."""
    code = returncode or 0
    # unshare re-raises its child's signal; a shell-style 128+N is decoded too.
    sig = -code if code < 0 else code - 128 if code > 128 else 0
    cpu_s = limits.cpu_s or math.ceil(limits.timeout_s)
    if sig in (signal.SIGXCPU, signal.SIGKILL):
        return "timeout", f"CPU time limit of {cpu_s} s exceeded (killed by {signal.Signals(sig).name})"
    if sig:
        return "crashed", f"killed by {signal.Signals(sig).name if sig < signal.NSIG else sig}"
    tail = output.decode("utf-8", "replace").strip().splitlines()
    last = tail[-1] if tail else "no output"
    return "crashed", _one_line(f"exited with code {code} before the tests finished: {last}")


def _one_line(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= _MESSAGE_CHARS else text[: _MESSAGE_CHARS - 3] + "..."


# ----------------------------------------------------------------------------------------------------
# Child side: the harness (runs as ``python -I sandbox.py JOB`` in the scratch directory)
# ----------------------------------------------------------------------------------------------------


class _OutputLimit(BaseException):
    """Raised by the captured stdout of an stdin/stdout test; a BaseException so ``except Exception``
    in the code does not swallow it."""


class _Harness:
    def __init__(self, job: dict):
        self.limits = job["limits"]
        self.results = os.fdopen(job["result_fd"], "w", encoding="utf-8", buffering=1)
        self.scratch = os.path.realpath(os.getcwd())
        self.refused = False
        self.output_over = False

    def emit(self, **event) -> None:
        self.results.write(json.dumps(event) + "\n")
        self.results.flush()

    # ---- limits and the audit hook -------------------------------------------------------------
    def set_limits(self) -> None:
        import resource

        lim = self.limits
        cpu = lim["cpu_s"] or math.ceil(lim["timeout_s"])
        wanted = {
            resource.RLIMIT_CPU: (cpu, cpu + 1),  # soft: SIGXCPU, hard: SIGKILL
            resource.RLIMIT_AS: (lim["memory_mb"] << 20,) * 2,
            resource.RLIMIT_NPROC: (lim["max_processes"],) * 2,
            resource.RLIMIT_FSIZE: (lim["max_file_mb"] << 20,) * 2,
            resource.RLIMIT_NOFILE: (lim["max_open_files"],) * 2,
            resource.RLIMIT_CORE: (0, 0),
        }
        for which, (soft, hard) in wanted.items():
            _, current_hard = resource.getrlimit(which)
            if current_hard != resource.RLIM_INFINITY:
                soft, hard = min(soft, current_hard), min(hard, current_hard)
            resource.setrlimit(which, (soft, hard))
        # Writing past RLIMIT_FSIZE raises SIGXFSZ, which would kill the process before Python sees
        # EFBIG; ignoring it turns the write into an OSError the harness reports as an error.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def audit(self, event: str, args: tuple) -> None:
        what = self._refusal(event, args)
        if what is None:
            return
        self.refused = True
        self.emit(event="forbidden", what=what)
        raise PermissionError(f"sandbox: {what} is not allowed")

    _NETWORK = frozenset(
        ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
         "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo")
    )  # fmt: skip
    _PROCESS = frozenset(
        ("os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
         "os.startfile")
    )  # fmt: skip
    _LIMITS = frozenset(("resource.setrlimit", "resource.prlimit"))
    # event -> positions of path arguments that must stay inside the scratch directory
    _PATHS = {
        "os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "shutil.rmtree": (0,), "os.mkdir": (0,),
        "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.symlink": (1,), "os.link": (1,),
        "os.utime": (0,), "shutil.copyfile": (1,), "shutil.move": (1,),
    }  # fmt: skip

    def _refusal(self, event: str, args: tuple) -> str | None:
        if event in self._NETWORK:
            target = args[1] if event.startswith("socket.connect") or event == "socket.sendto" else args[0]
            return f"network access ({event} {target!r})"
        if event in self._PROCESS:
            return f"process creation ({event})"
        if event in self._LIMITS:
            return f"changing resource limits ({event})"
        if event in ("os.kill", "os.killpg") and args and args[0] != os.getpid():
            return f"signalling another process ({event} {args[0]})"
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            writes = any(c in (mode or "") for c in "wax+") or (
                isinstance(flags, int)
                and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
            )
            if writes and not self._inside(path):
                return f"writing outside the scratch directory ({path})"
        paths = self._PATHS.get(event)
        if paths:
            for i in paths:
                if i < len(args) and not self._inside(args[i]):
                    return f"changing files outside the scratch directory ({event} {args[i]})"
        return None

    def _inside(self, path) -> bool:
        if isinstance(path, int) or path is None:  # an already open descriptor: its open was checked
            return True
        path = os.fsdecode(path)
        if path == "/dev/null":
            return True
        real = os.path.realpath(path)
        return real == self.scratch or real.startswith(self.scratch + os.sep)

    # ---- running the tests ---------------------------------------------------------------------
    def run(self, code: str, tests: dict) -> None:
        import builtins

        try:
            program = compile(code, "solution.py", "exec")
        except (SyntaxError, ValueError) as err:
            where = f" (line {err.lineno})" if getattr(err, "lineno", None) else ""
            self.emit(event="fatal", status="syntax_error", message=f"{type(err).__name__}: {err.msg}{where}"
                      if isinstance(err, SyntaxError) else f"{type(err).__name__}: {err}")  # fmt: skip
            return
        if tests["kind"] == "asserts":
            self.run_asserts(program, tests["source"], builtins)
        else:
            self.run_io(program, tests["cases"], builtins)
        self.emit(event="done")

    def run_asserts(self, program, source: str, builtins) -> None:
        scope = {"__name__": "solution", "__builtins__": builtins}
        if not self.guarded(lambda: exec(program, scope), "the code"):
            return
        tree = ast.parse(source)
        asserts = [node for node in tree.body if isinstance(node, ast.Assert)]
        if not asserts:  # no asserts: the whole test code is one test that passes if it runs
            self.emit(event="test", ok=self.guarded(lambda: exec(compile(source, "tests.py", "exec"), scope),
                                                    "the tests", fatal=False) is True)  # fmt: skip
            return
        number = 0
        for node in tree.body:
            statement = compile(ast.Module([node], []), "tests.py", "exec")
            if isinstance(node, ast.Assert):
                number += 1
                what = f"test {number} ({ast.get_source_segment(source, node) or 'assert'})"
                outcome = self.guarded(lambda s=statement: exec(s, scope), _clip(what, 120), fatal=False)
                if outcome is None:
                    return
                self.emit(event="test", ok=outcome is True, message="" if outcome is True else outcome)
            elif not self.guarded(lambda s=statement: exec(s, scope), f"test setup (line {node.lineno})"):
                return

    def run_io(self, program, cases: list, builtins) -> None:
        import io

        harness = self

        class CappedBytes(io.BytesIO):
            def write(self, data) -> int:
                if self.tell() + len(data) > harness.limits["max_output_bytes"]:
                    harness.output_over = True
                    raise _OutputLimit
                return super().write(data)

        for number, (stdin, expected) in enumerate(cases, start=1):
            captured = CappedBytes()
            saved = sys.stdin, sys.stdout
            sys.stdin = io.TextIOWrapper(io.BytesIO(stdin.encode()), encoding="utf-8")
            sys.stdout = io.TextIOWrapper(captured, encoding="utf-8", write_through=True)
            scope = {"__name__": "__main__", "__builtins__": builtins}
            try:
                outcome = self.guarded(
                    lambda s=scope: _exec_program(program, s), f"test {number}", fatal=False
                )
                got = captured.getvalue().decode("utf-8", "replace")
            finally:
                # detach, so dropping the wrapper does not close (and lose) the captured buffer
                sys.stdout.detach() if isinstance(sys.stdout, io.TextIOWrapper) else None
                sys.stdin, sys.stdout = saved
            if outcome is None:
                return
            if outcome is True and not _same_output(got, expected):
                outcome = f"test {number}: wrong output {_clip(got)!r}, expected {_clip(expected)!r}"
            self.emit(event="test", ok=outcome is True, message="" if outcome is True else outcome)

    def guarded(self, action, what: str, fatal: bool = True):
        """Run ``action``: True when it ran; a failure message (``fatal=False``) or False when it raised;
        None when the whole sample must stop (memory, output cap, a refused operation)."""
        try:
            action()
        except MemoryError:
            self.emit(event="fatal", status="memory", message=f"MemoryError in {what} (limit "
                      f"{self.limits['memory_mb']} MB)")  # fmt: skip
            return None
        except _OutputLimit:
            pass
        except OSError as err:
            if err.errno != errno.EFBIG:
                return self._failed(f"{what}: {type(err).__name__}: {err}{_solution_line(err)}", fatal)
            self.emit(event="fatal", status="file_limit",
                      message=f"{what}: a file over {self.limits['max_file_mb']} MB")  # fmt: skip
            return None
        except BaseException as err:  # the code's own exceptions, SystemExit and KeyboardInterrupt included
            if not (self.refused or self.output_over):
                return self._failed(f"{what}: {type(err).__name__}: {err}{_solution_line(err)}", fatal)
        if self.output_over:
            self.emit(event="fatal", status="output_limit",
                      message=f"{what}: output over {self.limits['max_output_bytes']} bytes")  # fmt: skip
            return None
        if self.refused:  # reported by the audit hook already; the code may have caught the error
            return None
        return True

    def _failed(self, message: str, fatal: bool):
        if fatal:
            self.emit(event="fatal", status="error", message=message)
            return False
        return message


def _exec_program(program, scope: dict) -> None:
    """Run a stdin/stdout program; ``exit()`` / ``sys.exit(0)`` end it normally."""
    try:
        exec(program, scope)
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise
    finally:
        sys.stdout.flush()


def _same_output(got: str, expected: str) -> bool:
    """Equal up to trailing whitespace on each line and trailing blank lines."""

    def lines(text: str) -> list[str]:
        out = [line.rstrip() for line in text.strip("\n").splitlines()]
        while out and not out[-1]:
            out.pop()
        return out

    return lines(got) == lines(expected)


def _clip(text: str, chars: int = 60) -> str:
    return text if len(text) <= chars else text[: chars - 3] + "..."


def _solution_line(err: BaseException) -> str:
    """ " (solution.py line N)" for the innermost frame of the code in the traceback, if any."""
    line = None
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "solution.py":
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" (solution.py line {line})" if line else ""


def _child_main(job_path: str) -> None:
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    os.unlink(job_path)
    harness = _Harness(job)
    harness.set_limits()
    sys.addaudithook(harness.audit)
    harness.run(job["code"], job["tests"])


if __name__ == "__main__":
    _child_main(sys.argv[1])
