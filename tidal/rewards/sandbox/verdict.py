"""The trainer side's half of the tests: what is sent into the sandbox, and the score from what comes back.

The score is decided here, outside the sandbox, from facts the code cannot fake:

- stdin/stdout tests: only the stdins go in; each case's output comes back and is compared here with
  the expected output, which never entered the sandbox.
- ``assert EXPR == LITERAL`` (either side a Python literal, the usual MBPP/HumanEval form): only
  ``EXPR`` goes in; its value comes back as plain data (``harness.encode``) and is compared here with
  the literal. Code that does not compute the right value cannot pass, whatever it writes.
- any other assert (``assert abs(f(x) - 1.5) < 1e-6``, a test block without asserts) runs in the
  sandbox, which reports whether it held: code can fake those, and can read their source.

Each test is counted at most once (the first report for its index, reports for unknown indices are
dropped), so ``passed <= total`` and the score is in [0, 1] whatever the code writes on the pipe.
"""

from __future__ import annotations

import ast
import json
import math
import signal
from collections.abc import Sequence
from dataclasses import dataclass

from tidal.rewards.sandbox.config import SCORED_STATUSES, STATUSES, SandboxLimits, SandboxResult, TestCase

_MESSAGE_CHARS = 300
_NO_VALUE = object()


@dataclass(frozen=True)
class Check:
    """How the trainer judges one test: ``kind`` is "io" (expected stdout), "value" (expected literal)
    or "raw" (the sandbox's own report); ``what`` names the test in messages."""

    kind: str
    what: str
    expected: object = None


@dataclass(frozen=True)
class Spec:
    """The tests as sent into the sandbox (``job``) and as judged outside (``checks``)."""

    job: dict
    checks: tuple[Check, ...]

    @property
    def total(self) -> int:
        return len(self.checks)


def build_spec(tests: Sequence[TestCase] | str) -> Spec:
    """Split ``tests`` into the part the sandbox sees and the part kept here; ValueError if malformed."""
    if isinstance(tests, str):
        return _assert_spec(tests)
    cases = list(tests)
    if not cases or not all(isinstance(c, TestCase) for c in cases):
        raise ValueError(
            f"tests are a {type(tests).__name__}; expected a string of assert statements or a non-empty "
            "list of TestCase(stdin, stdout)"
        )
    checks = tuple(Check("io", f"test {i + 1}", c.stdout) for i, c in enumerate(cases))
    return Spec({"kind": "io", "stdins": [c.stdin for c in cases]}, checks)


def _assert_spec(source: str) -> Spec:
    try:
        tree = ast.parse(source)
    except SyntaxError as err:
        raise ValueError(f"test code does not parse: {err.msg} (line {err.lineno})") from err
    if not any(isinstance(node, ast.Assert) for node in tree.body):
        # no top-level asserts: the whole test code is one test that passes if it runs
        step = {"index": 0, "mode": "raw", "source": source}
        return Spec({"kind": "asserts", "steps": [step]}, (Check("raw", "test 1 (the test code)"),))
    steps, checks = [], []
    for node in tree.body:
        if not isinstance(node, ast.Assert):
            steps.append({"source": ast.unparse(node), "line": node.lineno})
            continue
        index = len(checks)
        what = f"test {index + 1} ({_clip(ast.get_source_segment(source, node) or 'assert', 120)})"
        expr, expected = _literal_comparison(node.test)
        if expected is _NO_VALUE:
            steps.append({"index": index, "mode": "raw", "source": ast.unparse(node)})
            checks.append(Check("raw", what))
        else:
            steps.append({"index": index, "mode": "value", "source": ast.unparse(expr)})
            checks.append(Check("value", what, expected))
    return Spec({"kind": "asserts", "steps": steps}, tuple(checks))


def _literal_comparison(test: ast.expr) -> tuple[ast.expr | None, object]:
    """(the computed side, the literal) of ``A == B`` where exactly one side is a literal."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return None, _NO_VALUE
    left, right = test.left, test.comparators[0]
    left_value, right_value = _literal(left), _literal(right)
    if right_value is not _NO_VALUE and left_value is _NO_VALUE:
        return left, right_value
    if left_value is not _NO_VALUE and right_value is _NO_VALUE:
        return right, left_value
    return None, _NO_VALUE


def _literal(node: ast.expr) -> object:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NO_VALUE


def decode(data, depth: int = 0):
    """The inverse of ``harness.encode``, building only builtin plain data; ValueError when malformed."""
    if not isinstance(data, dict) or len(data) != 1 or depth > 64:
        raise ValueError("malformed value")
    (tag, body), = data.items()  # fmt: skip
    if tag == "p" and (body is None or type(body) in (bool, int, float, str)):
        return body
    if tag == "b" and isinstance(body, str):
        return bytes.fromhex(body)
    if tag == "c" and isinstance(body, list) and len(body) == 2:
        return complex(float(body[0]), float(body[1]))
    if tag == "d" and isinstance(body, list):
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in body}
    containers = {"l": list, "t": tuple, "s": set, "f": frozenset}
    if tag in containers and isinstance(body, list):
        return containers[tag](decode(item, depth + 1) for item in body)
    raise ValueError("malformed value")


def judge(spec: Spec, events: list[dict]) -> tuple[int, str]:
    """(tests passed, the first failure's message) from the sandbox's reports, judged by ``spec``."""
    first: dict[int, dict] = {}
    for event in events:
        index = event.get("index")
        if event.get("event") == "test" and type(index) is int and 0 <= index < spec.total:
            first.setdefault(index, event)
    passed, failure = 0, ""
    for index, check in enumerate(spec.checks):
        ok, message = _judge_one(check, first.get(index))
        passed += ok
        failure = failure or message
    return passed, failure


def _judge_one(check: Check, event: dict | None) -> tuple[bool, str]:
    if event is None:
        return False, f"{check.what}: did not run"
    if "error" in event:
        return False, _named(check, str(event["error"]))
    if check.kind == "raw":
        return event.get("ok") is True, _named(check, str(event.get("message", "")))
    if check.kind == "io":
        got = event.get("stdout")
        if isinstance(got, str) and same_output(got, check.expected):
            return True, ""
        return False, f"{check.what}: wrong output {_clip(str(got))!r}, expected {_clip(check.expected)!r}"
    try:
        value = decode(event.get("value"))
        ok = value == check.expected
    except (ValueError, TypeError, RecursionError, OverflowError):
        return False, f"{check.what}: malformed value"
    return (True, "") if ok else (False, f"{check.what}: AssertionError: got {_clip(repr(value))}")


def _named(check: Check, message: str) -> str:
    """The harness's "test N: ..." message with the test's full name (its assert) instead."""
    short = check.what.split(" (", 1)[0] + ": "
    return check.what + ": " + message[len(short) :] if message.startswith(short) else message


def same_output(got: str, expected: str) -> bool:
    """Equal up to trailing whitespace on each line and trailing blank lines."""

    def lines(text: str) -> list[str]:
        out = [line.rstrip() for line in text.strip("\n").splitlines()]
        while out and not out[-1]:
            out.pop()
        return out

    return lines(got) == lines(expected)


def verdict(
    spec: Spec, output: bytes, events: list[dict], ended: str, returncode: int | None, limits: SandboxLimits
) -> SandboxResult:
    """The sample's result from how the sandbox ended and what the trainer verified of its reports."""
    total = spec.total
    if not any(e.get("event") == "ready" for e in events):  # the harness never started
        return SandboxResult(
            0, total, "sandbox_error", one_line(f"the sandbox did not start: {_last(output)}")
        )
    passed, first_failure = judge(spec, events)
    forbidden = next((e for e in events if e.get("event") == "forbidden"), None)
    fatal = next((e for e in events if e.get("event") == "fatal"), None)
    if forbidden is not None:
        return SandboxResult(passed, total, "forbidden", one_line(f"refused: {forbidden.get('what')}"))
    if ended == "output_limit":
        return SandboxResult(passed, total, "output_limit", f"output over {limits.max_output_bytes} bytes")
    if ended == "timeout":
        message = f"wall-clock timeout after {limits.timeout_s:g} s ({passed}/{total} passed)"
        return SandboxResult(passed, total, "timeout", message)
    if fatal is not None:
        status = fatal.get("status")
        status = status if status in STATUSES and status not in SCORED_STATUSES else "error"
        return SandboxResult(passed, total, status, one_line(fatal.get("message", "")))
    if not any(e.get("event") == "done" for e in events):
        return SandboxResult(passed, total, *_death(returncode, output, limits))
    if passed == total:
        return SandboxResult(passed, total, "passed", f"{passed}/{total} tests passed")
    return SandboxResult(passed, total, "failed", one_line(f"{passed}/{total} passed; {first_failure}"))


def _death(returncode: int | None, output: bytes, limits: SandboxLimits) -> tuple[str, str]:
    """(status, message) for a sandbox that ended without its harness saying it was done."""
    code = returncode or 0
    # bwrap and the shell report a killed child as 128+N; Popen as -N.
    sig = -code if code < 0 else code - 128 if code > 128 else 0
    cpu_s = limits.cpu_s or math.ceil(limits.timeout_s)
    if sig in (signal.SIGXCPU, signal.SIGKILL):
        return "timeout", f"CPU time limit of {cpu_s} s exceeded (killed by {signal.Signals(sig).name})"
    if sig:
        return "crashed", f"killed by {signal.Signals(sig).name if sig < signal.NSIG else sig}"
    return "crashed", one_line(f"exited with code {code} before the tests finished: {_last(output)}")


def parse_events(raw: bytes) -> list[dict]:
    """The JSON lines of the result pipe; anything else (a line cut by a kill, garbage) is skipped."""
    events = []
    for line in raw.decode("utf-8", "replace").splitlines():
        try:
            event = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def _last(output: bytes) -> str:
    tail = output.decode("utf-8", "replace").strip().splitlines()
    return tail[-1] if tail else "no output"


def one_line(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= _MESSAGE_CHARS else text[: _MESSAGE_CHARS - 3] + "..."


def _clip(text: str, chars: int = 60) -> str:
    return text if len(text) <= chars else text[: chars - 3] + "..."
