"""The code sandbox: scores, each failure kind's status, no process left behind, the bounded pool, the
refusal without bubblewrap and the warned opt-out, the reward_func example through the reward loader.
(Attacks that must be contained: test_sandbox_attacks.py.)"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

import pytest

from tidal.rewards import load_reward_source
from tidal.rewards.sandbox import (
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    TestCase,
    extract_code,
    isolation,
    parse_tests,
    run_tests,
    runner,
)

pytestmark = [
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (apt-get install bubblewrap)"),
    pytest.mark.usefixtures("no_sandbox_left"),  # conftest.py: no sandbox process outlives a test
]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ADD_TESTS = "assert add(1, 2) == 3\nassert add(2, 2) == 4"
# small limits keep each failure fast: 1 s of wall clock, 256 MB, 64 KB of output, 4 processes, 1 MB files
SMALL = SandboxLimits(timeout_s=1.0, memory_mb=256, max_output_bytes=1 << 16, max_processes=4, max_file_mb=1)
# generous wall clock for samples that finish: the machine is shared and Python startup can be slow
FINISHING = SandboxLimits(
    timeout_s=20.0, memory_mb=256, max_output_bytes=1 << 16, max_processes=4, max_file_mb=1, scratch_mb=2
)


def test_correct_solution_scores_one():
    result = run_tests("def add(a, b):\n    return a + b", ADD_TESTS, FINISHING)
    assert result == SandboxResult(2, 2, "passed", "2/2 tests passed")
    assert result.score == 1.0


def test_partial_solution_scores_half_and_names_the_failed_assert():
    result = run_tests("def add(a, b):\n    return 3", ADD_TESTS, FINISHING)
    assert (result.passed, result.total, result.status, result.score) == (1, 2, "failed", 0.5)
    assert "assert add(2, 2) == 4" in result.message


def test_stdin_stdout_cases():
    code = "import sys\na, b = map(int, sys.stdin.readline().split())\nprint(a + b)\nexit()"
    result = run_tests(code, [TestCase("1 2\n", "3\n"), TestCase("2 2", "5")], FINISHING)
    assert (result.passed, result.total, result.status) == (1, 2, "failed")
    assert "wrong output '4\\n', expected '5'" in result.message


def test_literal_asserts_are_judged_outside_and_others_inside():
    # == a literal: the value comes back and is compared outside (plain data of every builtin kind);
    # the other asserts and the setup between them run inside, in order
    code = "def f(x):\n    return {'a': [x, (x, 2.5)], 'b': {x}, 'c': b'x', 'd': None, 'e': 1j}"
    tests = (
        "assert f(1) == {'a': [1, (1, 2.5)], 'b': {1}, 'c': b'x', 'd': None, 'e': 1j}\n"
        "y = f(2)\n"
        "assert 2 in y['b']\n"
        "assert [2, (2, 2.5)] == y['a']\n"
        "assert f(3) == {'a': [3, [3, 2.5]]}"  # a list is not a tuple
    )
    result = run_tests(code, tests, FINISHING)
    assert (result.passed, result.total, result.status) == (3, 4, "failed"), result
    assert (
        "test 4 (assert f(3) == {'a': [3, [3, 2.5]]}): AssertionError: got {'a': [3, (3, 2.5)]"
        in result.message
    )
    # a value that is not plain data fails its test, whatever its __eq__ says
    sneaky = "class Any:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Any()"
    result = run_tests(sneaky, ADD_TESTS, FINISHING)
    assert (result.passed, result.status) == (0, "failed") and "not plain data" in result.message


FAILURES = {
    "raise": ("raise ValueError('boom')", "error", "ValueError: boom (solution.py line 1)"),
    "syntax error": ("def add(a, b)\n    return a + b", "syntax_error", "SyntaxError"),
    "infinite loop": ("while True:\n    pass", "timeout", "timeout after 1 s"),
    "infinite output": ("while True:\n    print('x')", "output_limit", "output over 65536 bytes"),
    "4 GB allocation": ("x = bytearray(4 * 2**30)", "memory", "MemoryError"),
    "fork bomb": ("import os\nwhile True:\n    os.fork()", "forbidden", "process creation (os.fork)"),
    "subprocess": ("import subprocess\nsubprocess.run(['true'])", "forbidden", "process creation"),
    # the code catches the refusal and defines add: still 0, the attempt was reported
    "socket connect": (
        "import socket\ntry:\n    socket.socket().connect(('127.0.0.1', 9))\nexcept OSError:\n    pass\n"
        "def add(a, b):\n    return a + b",
        "forbidden",
        "network access (socket.connect ('127.0.0.1', 9))",
    ),
    "huge file": (
        "with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * 65536)",
        "file_limit",
        "1 MB",
    ),
    # outside the scratch directory the file system is read-only, and the host's /tmp is not there
    "write outside": ("open('/tmp/tidal_sandbox_escape', 'w')", "error", "FileNotFoundError"),
    "fill the scratch": (
        "for i in range(4):\n    open(f'f{i}', 'wb').write(b'x' * ((1 << 20) - 1))",
        "error",
        "No space left on device",
    ),
    "hard exit": ("import os\nos._exit(0)", "crashed", "exited with code 0"),
}


@pytest.mark.parametrize("kind", list(FAILURES))
def test_failure_kinds_score_zero_with_their_status(kind):
    code, status, message = FAILURES[kind]
    limits = SMALL if status in ("timeout", "output_limit") else FINISHING
    result = run_tests(code, ADD_TESTS, limits)
    assert result.status == status, result
    assert result.score == 0.0
    assert message in result.message and "\n" not in result.message
    assert not os.path.exists("/tmp/tidal_sandbox_escape")


def test_timeout_kills_the_whole_sample():
    # threads and a process forked through libc (past the policy hook) all die at the deadline
    code = (
        "import ctypes, threading, time\n"
        "threading.Thread(target=lambda: time.sleep(60), daemon=True).start()\n"
        "ctypes.CDLL(None).fork()\n"
        "while True:\n    time.sleep(0.05)"
    )
    assert run_tests(code, ADD_TESTS, SMALL).status == "timeout"


@pytest.mark.skipif(os.geteuid() == 0, reason="Linux does not apply RLIMIT_NPROC to root")
def test_libc_fork_bomb_is_bounded_by_the_process_limit():
    # ctypes calls fork() directly, past the audit hook: RLIMIT_NPROC (4) and the kill bound it.
    code = "import ctypes\nlibc = ctypes.CDLL(None)\nwhile True:\n    libc.fork()"
    result = run_tests(code, ADD_TESTS, SMALL)
    assert result.score == 0.0 and result.status in ("timeout", "crashed", "error")


def test_scratch_is_a_private_tmpfs_cwd():
    code = "import os\nCWD = os.getcwd()\nopen('note.txt', 'w').write('x')\nHOME = os.environ['HOME']"
    tests = "import os\nassert os.path.exists('note.txt')\nassert CWD == '/sandbox'\nassert HOME == CWD"
    assert run_tests(code, tests, FINISHING).status == "passed"
    assert not os.path.exists("/sandbox")  # the sandbox's own tmpfs, not a host folder


def test_without_bubblewrap_it_refuses_with_how_to_install(monkeypatch):
    monkeypatch.setattr(isolation.shutil, "which", lambda name: None)
    isolation.check_bwrap.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap") as err:
            run_tests("x = 1", ADD_TESTS, FINISHING)
        assert "\n" not in str(err.value)
        with pytest.raises(SandboxUnavailable):
            runner.run_many([("x = 1", ADD_TESTS)], FINISHING)
    finally:
        isolation.check_bwrap.cache_clear()


def test_isolation_none_is_an_explicit_opt_out_that_warns(caplog):
    isolation.warn_no_isolation.cache_clear()
    with caplog.at_level(logging.WARNING, logger="tidal.rewards.sandbox"):
        result = run_tests("import os\nCWD = os.getcwd()", "assert CWD == ''", FINISHING, isolation="none")
    assert "WITHOUT isolation" in caplog.text
    scratch = result.message.rsplit("got ", 1)[1].strip("'")
    assert Path(scratch).name.startswith("tidal-sandbox-") and not Path(scratch).exists()
    with pytest.raises(ValueError, match="isolation='chroot'"):
        SandboxLimits(isolation="chroot")


def test_bad_tests_and_limits_are_clear_errors():
    with pytest.raises(ValueError, match="test code does not parse"):
        run_tests("x = 1", "assert (")
    with pytest.raises(ValueError, match="expected a string of assert statements"):
        run_tests("x = 1", [("1", "2")])
    with pytest.raises(ValueError, match="timeout_s=0"):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError, match="label of sample 3"):
        parse_tests({"inputs": ["1"]}, "label of sample 3")


def test_extract_code_and_parse_tests():
    response = "Here:\n```text\nno\n```\n```python\ndef f():\n    return 1\n```\n"
    assert extract_code(response) == "def f():\n    return 1\n"
    assert extract_code("```\nx = 1\n```") == "x = 1\n"
    assert extract_code("no code") is None
    assert parse_tests('{"inputs": ["1 2"], "outputs": ["3"]}') == [TestCase("1 2", "3")]
    assert parse_tests([{"input": "1", "output": "2"}]) == [TestCase("1", "2")]
    assert parse_tests("assert f() == 1") == "assert f() == 1"


def test_run_many_runs_samples_concurrently_in_order(monkeypatch):
    # two samples must be in flight at once for the barrier to open (a serial pool would time out)
    barrier = threading.Barrier(2, timeout=30)
    in_flight, peak, lock = [0], [0], threading.Lock()

    def fake_child(code, spec, limits):
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        barrier.wait()
        with lock:
            in_flight[0] -= 1
        return SandboxResult(int(code), 1, "passed" if code == "1" else "failed")

    monkeypatch.setattr(runner, "_run_child", fake_child)
    results = runner.run_many([(str(i % 2), "assert True") for i in range(6)], FINISHING, concurrency=2)
    assert [r.passed for r in results] == [0, 1, 0, 1, 0, 1]
    assert peak[0] == 2


def test_example_reward_func_through_the_reward_loader(monkeypatch):
    source = load_reward_source(str(EXAMPLES / "code_reward_func.py"))
    prompt = "Write add(a, b).\n"
    good = prompt + "```python\ndef add(a, b):\n    return a + b\n```"
    half = prompt + "```python\ndef add(a, b):\n    return 3\n```"
    loop = prompt + "```python\nwhile True:\n    pass\n```"
    labels = [ADD_TESTS, ADD_TESTS, ADD_TESTS, ADD_TESTS]
    monkeypatch.setitem(source.func.__globals__, "LIMITS", SandboxLimits(timeout_s=3.0, memory_mb=256))
    result = source([good, half, loop, prompt + "no code"], [prompt] * 4, labels)
    assert result.rewards.tolist() == [1.0, 0.5, 0.0, 0.0]
    assert result.extra_logs["sandbox/timeout"] == 0.25
    assert result.extra_logs["sandbox/no_code"] == 0.25
    assert result.extra_logs["sandbox/pass_rate"] == pytest.approx(0.375)
