"""Attacks on the code sandbox (issue #30) that must be contained under the default settings: after each
call no file outside the sandbox changed or appeared, no process of the sample is alive, and the score
is within [0, 1]. Several attacks first switch the harness's audit-hook policy off (it is not the
boundary: bubblewrap is), so they test the real containment."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tidal.rewards.sandbox import SandboxLimits, TestCase, run_tests, seccomp
from tidal.rewards.sandbox.cgroup import pids_cgroup_parent
from tidal.rewards.sandbox.isolation import HARNESS

pytestmark = [
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (apt-get install bubblewrap)"),
    pytest.mark.usefixtures("no_sandbox_left"),  # conftest.py: no sandbox process outlives a test
]
LIMITS = SandboxLimits(
    timeout_s=20.0, memory_mb=256, max_output_bytes=1 << 16, max_processes=4, max_file_mb=1
)
ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = "assert add(1, 2) == 3\nassert add(2, 2) == 4"
# Switch the harness's policy hook off from inside: empty its table of refused audit events.
UNHOOK = (
    "import gc\ntype(next(o for o in gc.get_objects() if type(o).__name__ == 'Harness'))._REFUSED.clear()\n"
)


@pytest.fixture
def host_dir(tmp_path):
    """A folder outside the sandbox with a copy of tidal/__init__.py (mode 600, like a secret)."""
    source = Path(__file__).resolve().parents[2] / "tidal" / "__init__.py"
    (tmp_path / "victim.py").write_bytes(source.read_bytes())
    (tmp_path / "victim.py").chmod(0o600)
    return tmp_path


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() if p.is_file() else b"<not a file>" for p in sorted(folder.iterdir())}


def run_contained(code: str, tests=ADD_TESTS, **limits):
    result = run_tests(code, tests, LIMITS, **limits)
    assert 0.0 <= result.score <= 1.0 and 0 <= result.passed <= result.total, result
    return result


def test_file_attacks_outside_scratch_change_nothing(host_dir):
    victim = host_dir / "victim.py"
    before = snapshot(host_dir)
    attacks = [
        f"os.unlink('victim.py', dir_fd=os.open({str(host_dir)!r}, os.O_RDONLY))",
        f"os.close(os.open('new.txt', os.O_CREAT | os.O_WRONLY, dir_fd=os.open({str(host_dir)!r}, os.O_RDONLY)))",
        f"os.rename({str(victim)!r}, {str(host_dir / 'moved.py')!r})",
        f"os.mknod({str(host_dir / 'node')!r})",
        f"os.mkfifo({str(host_dir / 'fifo')!r})",
        f"os.link({str(victim)!r}, 'linked.py'); open('linked.py', 'a').write('pwned')",
        f"open({str(victim)!r}, 'a').write('pwned')",
        # the harness file is bound read-only into the sandbox: neither appending nor a hard link works
        "open('/tidal/harness.py', 'a').write('pwned')",
        "os.link('/tidal/harness.py', 'h.py'); open('h.py', 'a').write('pwned')",
        "open(os.__file__, 'a').write('pwned')",
    ]
    harness_before = Path(HARNESS).read_bytes()
    body = "".join(f"try:\n    {attack}\nexcept OSError:\n    pass\n" for attack in attacks)
    result = run_contained("import os\n" + UNHOOK + body + ADD)
    assert result.status == "passed", result  # the code caught every refusal: scored, but harmless
    assert snapshot(host_dir) == before
    assert Path(HARNESS).read_bytes() == harness_before


def test_disabled_policy_then_shell_or_processes_reach_nothing(host_dir):
    before = snapshot(host_dir)
    target = str(host_dir / "pwned")
    write = f"open({target!r}, 'w')"
    code = (
        "import os, subprocess, sys, ctypes\n" + UNHOOK + "RESULTS = []\n"
        f"RESULTS.append(os.system('touch {target}'))\n"
        f"RESULTS.append(ctypes.CDLL(None).system(b'touch {target}'))\n"
        "try:\n"
        f"    RESULTS.append(subprocess.run([sys.executable, '-c', {write!r}]).returncode)\n"
        "except OSError as err:\n"
        "    RESULTS.append(type(err).__name__)\n"
    )
    result = run_contained(code, "assert RESULTS == []")
    assert result.status == "failed", result  # it ran: the shells and the child failed inside
    assert snapshot(host_dir) == before


def test_fork_exec_below_the_audit_hook_reaches_nothing(host_dir):
    before = snapshot(host_dir)
    target = str(host_dir / "pwned")
    write = f"open({target!r}, 'w')"
    # _posixsubprocess.fork_exec starts a process without any audit event (signatures of 3.11+, 3.10)
    code = (
        "import _posixsubprocess, os, sys\n"
        "exe = sys.executable.encode()\n"
        "errpipe = os.pipe()\n"
        f"head = ([exe, b'-c', {write.encode()!r}], [exe], True, (errpipe[1],), None, None, -1, -1, -1, -1, -1, -1,"
        " *errpipe, False, False)\n"
        "try:\n"
        "    PID = _posixsubprocess.fork_exec(*head, -1, None, None, None, -1, None, False)\n"
        "except TypeError:\n"
        "    PID = _posixsubprocess.fork_exec(*head, None, None, None, -1, None)\n"
        "STATUS = os.waitpid(PID, 0)[1]\n"
    )
    result = run_contained(code, "assert PID > 0\nassert STATUS != 0")
    assert result.status == "passed", result  # the process started, and failed to write outside
    assert snapshot(host_dir) == before


def test_no_host_sockets_and_no_network(tmp_path):
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(tmp_path / "host.sock"))
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(f"\0tidal-sandbox-test-{os.getpid()}")
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    servers = (unix, abstract, tcp)
    for server in servers:
        server.listen(1)
        server.setblocking(False)
    targets = [
        (socket.AF_UNIX, str(tmp_path / "host.sock")),
        (socket.AF_UNIX, f"\0tidal-sandbox-test-{os.getpid()}"),
        (socket.AF_INET, tcp.getsockname()),
    ]
    code = "import socket\n" + UNHOOK + "REACHED = []\n"
    for family, address in targets:
        code += (
            f"try:\n    socket.socket({int(family)}).connect({address!r})\n    REACHED.append({address!r})\n"
            "except OSError:\n    pass\n"
        )
    try:
        result = run_contained(code, "assert REACHED == []")
        assert result.status == "passed", result
        for server in servers:
            with pytest.raises(BlockingIOError):
                server.accept()
    finally:
        for server in servers:
            server.close()


def test_host_files_and_host_proc_are_invisible(host_dir, monkeypatch):
    monkeypatch.setenv("TIDAL_SANDBOX_SECRET", "s3cr3t-in-the-trainer-env")
    code = (
        "import os\nSEEN = []\n"
        f"for path in ['/etc/passwd', '/etc/shadow', '/work', '/root/.bashrc', {str(host_dir / 'victim.py')!r}]:\n"
        "    if os.path.exists(path):\n"
        "        SEEN.append(path)\n"
        "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
        "    try:\n"
        "        if b's3cr3t' in open(f'/proc/{pid}/environ', 'rb').read():\n"
        "            SEEN.append(pid)\n"
        "    except OSError:\n"
        "        pass\n"
        "PIDS = len([p for p in os.listdir('/proc') if p.isdigit()])\n"
        "UID = os.getuid()\n"
    )
    # the sample's /proc shows its own PID namespace: bwrap's reaper and the harness
    result = run_contained(code, "assert SEEN == []\nassert PIDS <= 2\nassert UID == 65534")
    assert result.status == "passed", result


@pytest.mark.skipif(os.geteuid() != 0 or pids_cgroup_parent() is None, reason="needs root and a pids cgroup")
def test_pids_cgroup_cannot_be_left_and_bounds_libc_forks():
    # Try to leave the sample's cgroup (no cgroup filesystem inside), then fork through libc, past the
    # audit hook; as root RLIMIT_NPROC does not apply, the pids cgroup must refuse past max_processes (4).
    code = (
        "import ctypes, os\nESCAPED = []\n"
        "for path in ['/sys/fs/cgroup/pids/cgroup.procs', '/sys/fs/cgroup/cgroup.procs']:\n"
        "    try:\n"
        "        open(path, 'w').write(str(os.getpid()))\n"
        "        ESCAPED.append(path)\n"
        "    except OSError:\n"
        "        pass\n"
        "libc = ctypes.CDLL(None)\nFORKS = 0\n"
        "for _ in range(40):\n"
        "    pid = libc.fork()\n"
        "    if pid == 0:\n"
        "        libc.pause()\n"
        "    FORKS += pid > 0\n"
    )
    result = run_contained(code, "assert ESCAPED == []\nassert FORKS < 4, FORKS")
    assert result.status == "passed", result
    mine = f"tidal-sandbox-{os.getpid()}-"  # the sample's cgroup was emptied and removed
    assert not [p for p in Path(pids_cgroup_parent()).iterdir() if p.name.startswith(mine)]


def test_cannot_signal_host_processes():
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        code = (
            "import os, signal\n" + UNHOOK + "HIT = []\n"
            f"for pid in ({victim.pid}, {os.getpid()}, os.getppid()):\n"
            "    try:\n"
            "        signal.pidfd_send_signal(os.pidfd_open(pid), signal.SIGKILL) if pid != 1 else None\n"
            "        HIT.append(pid)\n"
            "    except OSError:\n"
            "        pass\n"
            f"    try:\n        os.kill({victim.pid}, signal.SIGKILL)\n    except OSError:\n        pass\n"
            + ADD
        )
        result = run_contained(code)
        assert victim.poll() is None, "the sandbox killed a host process"
        assert result.status == "passed", result
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()


def test_background_process_dies_with_the_call(host_dir):
    # double fork + setsid through libc, the grandchild renamed so it can be found from here whoever its
    # parent is by then; it would write a host file a moment later
    target = str(host_dir / "late")
    name = f"orph{os.getpid()}"
    code = (
        "import ctypes, os, time\nlibc = ctypes.CDLL(None)\n"
        "if libc.fork() == 0:\n"
        "    libc.setsid()\n"
        "    if libc.fork() == 0:\n"
        f"        libc.prctl(15, {name.encode()!r}, 0, 0, 0)\n"  # PR_SET_NAME
        "        time.sleep(0.5)\n"
        "        for _ in range(100):\n"
        "            try:\n"
        f"                open({target!r}, 'w')\n"
        "            except OSError:\n"
        "                pass\n"
        "            time.sleep(0.05)\n"
        "    os._exit(0)\n"
        "time.sleep(0.2)\n" + ADD
    )
    result = run_contained(code)
    assert result.status == "passed", result
    alive = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{entry}/comm").read_text().strip() == name:
                alive.append(entry)
        except OSError:
            continue
    assert alive == [] and not Path(target).exists()


FORGE = (
    "import gc\n"
    "harness = next(o for o in gc.get_objects() if type(o).__name__ == 'Harness')\n"
    "for i in range(100):\n"
    "    harness.emit(event='test', index=i, ok=True, value={'p': 0}, stdout='')\n"
    "harness.emit(event='done')\n"
)


def test_forged_reports_cannot_score_above_what_was_verified():
    # wrong code that reports 100 passes: literal asserts are judged outside from the values -> 0
    wrong = FORGE + "def add(a, b):\n    return 0\n"
    assert run_contained(wrong).score == 0.0
    # an assert judged inside can be faked, but only once per test: never above 1
    faked = run_contained(wrong, "assert add(1, 2) > 2\nassert add(1, 1) > 1")
    assert (faked.passed, faked.total) == (2, 2)
    # stdin/stdout: the expected output never enters the sandbox, so it cannot be found and echoed
    hunt = FORGE + (
        "import gc, sys\n"
        "found = [o for o in gc.get_objects() if isinstance(o, (list, dict)) and '8675309' in repr(o)]\n"
        "print('8675309' if found else 'not found')\n"
    )
    io = run_contained(hunt, [TestCase("", "8675309"), TestCase("", "8675309")])
    assert (io.passed, io.total, io.score) == (0, 2, 0.0), io


@pytest.mark.skipif(seccomp.filter_program() is None, reason="needs libseccomp (apt-get install libseccomp2)")
def test_seccomp_filter_and_no_new_namespaces():
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "STATUS = open('/proc/self/status').read()\n"
        "SECCOMP = [line.split()[1] for line in STATUS.splitlines() if line.startswith('Seccomp:')]\n"
        "CAPS = [line.split()[1] for line in STATUS.splitlines() if line.startswith('CapEff:')]\n"
        "PTRACE = libc.ptrace(16, 1, 0, 0), ctypes.get_errno()\n"  # PTRACE_ATTACH to the reaper
        "UNSHARE = libc.unshare(0x10000000), ctypes.get_errno()\n"  # CLONE_NEWUSER
        "MOUNT = libc.mount(b'none', b'/sandbox', b'tmpfs', 0, None), ctypes.get_errno()\n"
        "CLONE = libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0), ctypes.get_errno()\n"  # clone(CLONE_NEWUSER)
        "if CLONE[0] == 0:\n    os._exit(0)\n"
    )
    tests = (
        "assert SECCOMP == ['2']\nassert CAPS == ['0000000000000000']\n"
        "assert PTRACE == (-1, 1)\nassert UNSHARE == (-1, 1)\nassert MOUNT == (-1, 1)\nassert CLONE == (-1, 1)"
    )  # 1 == EPERM
    result = run_contained(code, tests)
    assert result.status == "passed", result
