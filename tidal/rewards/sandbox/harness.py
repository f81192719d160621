"""The harness that runs model-written code inside the sandbox: ``python -I -S -B harness.py JOB_FD OUT_FD``.

It reads its job (the code, the test steps, the limits) from ``JOB_FD``, sets the resource limits,
runs the code and reports one JSON line per test on ``OUT_FD``. It imports only the standard library
(it runs with the interpreter's stdlib alone, not tidal).

Nothing it reports is trusted by itself: the code shares this interpreter and can write anything on
``OUT_FD``. The trainer side (``verdict.py``) therefore scores from facts the code cannot fake: for
stdin/stdout tests it gets the program's output and compares it with an expected output that never
entered the sandbox; for ``assert EXPR == LITERAL`` it gets the value of ``EXPR`` as plain data and
compares it with a literal that was cut out of the test before it was sent. Other asserts are judged
here, so code can fake those (docs/recipes.md says so).
"""

from __future__ import annotations

import errno
import io
import json
import math
import os
import signal
import sys

_DEPTH = 64


class _OutputLimit(BaseException):
    """Raised by the captured stdout of a stdin/stdout test; a BaseException so ``except Exception``
    in the code does not swallow it."""


_BASES = (bool, int, float, str, bytes, complex, list, tuple, set, frozenset, dict)


def encode(value, depth: int = 0):
    """``value`` as tagged JSON-able plain data; TypeError for anything else. A subclass of a builtin
    (a namedtuple, an IntEnum, a Counter) is sent as its builtin base, which it compares equal to."""
    if depth > _DEPTH:
        raise TypeError("the value is nested too deeply")
    kind = next((base for base in _BASES if isinstance(value, base)), None)
    if value is None:
        return {"p": None}
    if kind is None:
        name = type(value).__name__
        raise TypeError(f"the value is a {name}, not plain data (None, bool, int, float, str, list, ...)")
    value = kind(value) if type(value) is not kind else value
    if kind in (bool, int, float, str):
        return {"p": value}
    if kind is bytes:
        return {"b": value.hex()}
    if kind is complex:
        return {"c": [value.real, value.imag]}
    if kind is dict:
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    tag = {list: "l", tuple: "t", set: "s", frozenset: "f"}[kind]
    return {tag: [encode(item, depth + 1) for item in value]}


class Harness:
    def __init__(self, job: dict, out_fd: int):
        self.limits = job["limits"]
        self.out = os.fdopen(out_fd, "w", encoding="utf-8", buffering=1)
        self.refused = False
        self.output_over = False

    def emit(self, **event) -> None:
        self.out.write(json.dumps(event) + "\n")
        self.out.flush()

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
        # Past RLIMIT_FSIZE the kernel sends SIGXFSZ; ignored, the write fails with EFBIG instead.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    # ---- policy: what a sample may not even try (it scores 0, status "forbidden") -------------------
    # Not a security boundary (the sandbox around this process is); it names honest mistakes.
    _REFUSED = {
        "socket.connect": "network access", "socket.bind": "network access", "socket.sendto": "network access",
        "socket.getaddrinfo": "network access", "socket.gethostbyname": "network access",
        "os.fork": "process creation", "os.forkpty": "process creation", "os.system": "process creation",
        "os.exec": "process creation", "os.posix_spawn": "process creation", "os.spawn": "process creation",
        "subprocess.Popen": "process creation",
    }  # fmt: skip

    def audit(self, event: str, args: tuple) -> None:
        what = self._REFUSED.get(event)
        if what is None:
            return
        target = f" {args[1]!r}" if event == "socket.connect" and len(args) > 1 else ""
        self.refused = True
        self.emit(event="forbidden", what=f"{what} ({event}{target})")
        raise PermissionError(f"sandbox: {what} is not allowed")

    # ---- running -------------------------------------------------------------------------------------
    def run(self, code: str, tests: dict) -> None:
        import builtins

        # exit() and quit() come from the site module, which -S leaves out; programs call them.
        builtins.exit = builtins.quit = sys.exit

        try:
            program = compile(code, "solution.py", "exec")
        except (SyntaxError, ValueError) as err:
            where = f" (line {err.lineno})" if getattr(err, "lineno", None) else ""
            text = err.msg if isinstance(err, SyntaxError) else str(err)
            self.emit(event="fatal", status="syntax_error", message=f"{type(err).__name__}: {text}{where}")
            return
        if tests["kind"] == "asserts":
            self.run_asserts(program, tests["steps"], builtins)
        else:
            self.run_io(program, tests["stdins"], builtins)
        self.emit(event="done")

    def run_asserts(self, program, steps: list, builtins) -> None:
        scope = {"__name__": "solution", "__builtins__": builtins}
        if not self.guarded(lambda: exec(program, scope), "the code"):
            return
        for step in steps:
            source, index = step["source"], step.get("index")
            if index is None:  # setup between the asserts
                if not self.guarded(lambda s=source: exec(s, scope), f"test setup (line {step['line']})"):
                    return
                continue
            what = f"test {index + 1}"
            if step["mode"] == "value":  # the trainer compares the value with the withheld literal
                box = []
                outcome = self.guarded(
                    lambda s=source, b=box: b.append(encode(eval(s, scope))), what, fatal=False
                )
                if outcome is None:
                    return
                event = {"value": box[0]} if outcome is True else {"error": outcome}
                self.emit(event="test", index=index, **event)
            else:
                outcome = self.guarded(lambda s=source: exec(s, scope), what, fatal=False)
                if outcome is None:
                    return
                self.emit(
                    event="test", index=index, ok=outcome is True, message="" if outcome is True else outcome
                )

    def run_io(self, program, stdins: list, builtins) -> None:
        harness = self

        class CappedBytes(io.BytesIO):
            def write(self, data) -> int:
                if self.tell() + len(data) > harness.limits["max_output_bytes"]:
                    harness.output_over = True
                    raise _OutputLimit
                return super().write(data)

        for index, stdin in enumerate(stdins):
            captured = CappedBytes()
            saved = sys.stdin, sys.stdout
            sys.stdin = io.TextIOWrapper(io.BytesIO(stdin.encode()), encoding="utf-8")
            sys.stdout = io.TextIOWrapper(captured, encoding="utf-8", write_through=True)
            scope = {"__name__": "__main__", "__builtins__": builtins}
            try:
                outcome = self.guarded(
                    lambda s=scope: _exec_program(program, s), f"test {index + 1}", fatal=False
                )
                got = captured.getvalue().decode("utf-8", "replace")
            finally:
                # detach, so dropping the wrapper does not close (and lose) the captured buffer
                sys.stdout.detach() if isinstance(sys.stdout, io.TextIOWrapper) else None
                sys.stdin, sys.stdout = saved
            if outcome is None:
                return
            self.emit(
                event="test", index=index, **({"stdout": got} if outcome is True else {"error": outcome})
            )

    def guarded(self, action, what: str, fatal: bool = True):
        """Run ``action``: True when it ran; a failure message (``fatal=False``) or False when it raised;
        None when the whole sample must stop (memory, output cap, file size, a refused operation)."""
        try:
            action()
        except MemoryError:
            limit = self.limits["memory_mb"]
            self.emit(event="fatal", status="memory", message=f"MemoryError in {what} (limit {limit} MB)")
            return None
        except _OutputLimit:
            pass
        except OSError as err:
            if err.errno != errno.EFBIG:
                return self._failed(f"{what}: {type(err).__name__}: {err}{_solution_line(err)}", fatal)
            limit = self.limits["max_file_mb"]
            self.emit(event="fatal", status="file_limit", message=f"{what}: a file over {limit} MB")
            return None
        except BaseException as err:  # the code's own exceptions, SystemExit and KeyboardInterrupt included
            if not (self.refused or self.output_over):
                return self._failed(f"{what}: {type(err).__name__}: {err}{_solution_line(err)}", fatal)
        if self.output_over:
            limit = self.limits["max_output_bytes"]
            self.emit(event="fatal", status="output_limit", message=f"{what}: output over {limit} bytes")
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


def _solution_line(err: BaseException) -> str:
    """ " (solution.py line N)" for the innermost frame of the code in the traceback, if any."""
    line = None
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "solution.py":
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" (solution.py line {line})" if line else ""


def main(job_fd: int, out_fd: int) -> None:
    with os.fdopen(job_fd, "rb") as f:
        job = json.loads(f.read())
    # Only stdin/stdout/stderr and the result pipe stay open for the code.
    os.closerange(3, out_fd)
    os.closerange(out_fd + 1, os.sysconf("SC_OPEN_MAX"))
    harness = Harness(job, out_fd)
    harness.emit(event="ready")  # before the code runs: a sample without it never started
    harness.set_limits()
    sys.addaudithook(harness.audit)
    harness.run(job["code"], job["tests"])


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
