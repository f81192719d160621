"""The code sandbox: scores, each failure kind's status, no process left behind, the bounded pool, the
reward_func example through the reward loader."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from tidal.rewards import load_reward_source, sandbox
from tidal.rewards.sandbox import SandboxLimits, SandboxResult, TestCase, extract_code, parse_tests, run_tests

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ADD_TESTS = "assert add(1, 2) == 3\nassert add(2, 2) == 4"
# small limits keep each failure fast: 1 s of wall clock, 256 MB, 64 KB of output, 4 processes, 1 MB files
SMALL = SandboxLimits(
    timeout_s=1.0, memory_mb=256, max_output_bytes=1 << 16, max_processes=4, max_file_mb=1, namespaces="auto"
)
# generous wall clock for samples that finish: the machine is shared and Python startup can be slow
FINISHING = SandboxLimits(
    timeout_s=20.0, memory_mb=256, max_output_bytes=1 << 16, max_processes=4, max_file_mb=1
)


def sandbox_processes() -> list[int]:
    """Live processes started by the sandbox (their command line names the scratch directory)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if b"tidal-sandbox-" in cmdline and state != "Z":
            found.append(int(entry))
    return found


@pytest.fixture(autouse=True)
def nothing_left_behind():
    before = set(sandbox_processes())  # another engineer's run on this machine is not ours
    yield
    assert set(sandbox_processes()) - before == set()


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
    "write outside": ("open('/tmp/tidal_sandbox_escape', 'w')", "forbidden", "outside the scratch directory"),
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


@pytest.mark.parametrize("namespaces", ["off", "auto"])
def test_fork_bomb_and_timeout_without_namespaces_too(namespaces):
    fork = run_tests(FAILURES["fork bomb"][0], ADD_TESTS, FINISHING, namespaces=namespaces)
    assert fork.status == "forbidden"
    # a grandchild that sleeps past the timeout is killed with its session
    loop = run_tests(
        "import time\nwhile True:\n    time.sleep(0.05)", ADD_TESTS, SMALL, namespaces=namespaces
    )
    assert loop.status == "timeout"


@pytest.mark.skipif(os.geteuid() == 0, reason="Linux does not apply RLIMIT_NPROC to root")
def test_libc_fork_bomb_is_bounded_by_the_process_limit():
    # ctypes calls fork() directly, past the audit hook: RLIMIT_NPROC (4) and the kill bound it.
    code = "import ctypes\nlibc = ctypes.CDLL(None)\nwhile True:\n    libc.fork()"
    result = run_tests(code, ADD_TESTS, SMALL)
    assert result.score == 0.0 and result.status in ("timeout", "crashed", "error")


@pytest.mark.skipif(
    os.geteuid() != 0 or sandbox._pids_cgroup_parent() is None, reason="needs root and a pids cgroup"
)
def test_root_libc_forks_are_bounded_by_the_pids_cgroup():
    # As root RLIMIT_NPROC does not apply; the sample's pids cgroup (pids.max = 4) must refuse the 5th
    # process. Children pause, so every successful fork stays alive and counts until the sweep.
    code = (
        "import ctypes\nlibc = ctypes.CDLL(None)\nFORKS = 0\n"
        "for _ in range(40):\n"
        "    pid = libc.fork()\n"
        "    if pid == 0:\n"
        "        libc.pause()\n"
        "    FORKS += pid > 0\n"
    )
    result = run_tests(code, "assert FORKS < 4, FORKS", FINISHING)
    assert result.status == "passed", result
    mine = f"tidal-sandbox-{os.getpid()}-"
    assert not [p for p in Path(sandbox._pids_cgroup_parent()).iterdir() if p.name.startswith(mine)]


def test_scratch_directory_is_the_cwd_and_is_removed():
    code = "import os\nCWD = os.getcwd()\nopen('note.txt', 'w').write('x')"
    # the second assert fails on purpose, so its message carries the scratch directory's path
    tests = "import os\nassert os.path.exists(os.path.join(CWD, 'note.txt'))\nassert CWD == '', CWD"
    result = run_tests(code, tests, FINISHING)
    assert (result.passed, result.status) == (1, "failed"), result
    scratch = result.message.rsplit("AssertionError: ", 1)[1]
    assert Path(scratch).name.startswith("tidal-sandbox-")
    assert not Path(scratch).exists()


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

    def fake_child(code, spec, limits, use_namespaces):
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        barrier.wait()
        with lock:
            in_flight[0] -= 1
        return SandboxResult(int(code), 1, "passed" if code == "1" else "failed")

    monkeypatch.setattr(sandbox, "_run_child", fake_child)
    results = sandbox.run_many([(str(i % 2), "assert True") for i in range(6)], FINISHING, concurrency=2)
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
