"""The command that starts the harness: inside bubblewrap (``isolation="bwrap"``), or bare (``"none"``).

The bubblewrap sandbox of one sample:

- mount namespace whose root is an empty tmpfs, read-only once set up, holding only: the interpreter's
  prefix (its binary, stdlib and shared library), ``/usr/lib`` (and ``/usr/lib64``, ``/lib*``) for libc
  and the stdlib's extension modules, all read-only; the harness file read-only; a fresh ``/proc`` of
  the sample's own PID namespace (read-only); a minimal ``/dev`` (null, zero, random, urandom, tty;
  read-only); and the scratch directory ``/sandbox``, a private tmpfs of ``scratch_mb`` (cwd, HOME,
  TMPDIR). No /etc, no /tmp, no /work, no host /proc or /sys, no host sockets.
- new user (uid/gid 65534 inside, every capability dropped, no further user namespaces: bwrap's
  ``--disable-userns`` where it has it, and the seccomp filter), PID (the
  harness's processes only; all of them die with it), network (loopback only, down), IPC, UTS and
  cgroup namespaces; ``--new-session`` (no TIOCSTI into the trainer's terminal); ``--die-with-parent``.
- the seccomp filter of ``seccomp.py`` where libseccomp is present; the rlimits the harness sets
  before the code runs (unprivileged inside, the code cannot raise them back); and, when the trainer
  is root, the pids cgroup of ``cgroup.py`` around bwrap, which the code cannot see.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys
import sysconfig

from tidal.rewards.sandbox.config import SandboxLimits, SandboxUnavailable

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness.py")
SCRATCH = "/sandbox"
_INNER_HARNESS = "/tidal/harness.py"
_UID = "65534"  # "nobody"
INSTALL_HINT = "apt-get install bubblewrap"
# Extra processes of the sample besides the code's: bwrap outside and its PID-1 reaper inside.
BWRAP_PROCESSES = 2
logger = logging.getLogger("tidal.rewards.sandbox")


def interpreter() -> str:
    """The real Python binary (a virtualenv's ``python`` is a link to it; the sandbox runs stdlib only)."""
    return os.path.realpath(sys.executable)


def inner_argv(harness: str, job_fd: int, out_fd: int) -> list[str]:
    # -I: no PYTHON* variables, user site or script dir; -S: no site-packages; -B: no .pyc files.
    return [interpreter(), "-I", "-S", "-B", "-X", "utf8", harness, str(job_fd), str(out_fd)]


def child_env(scratch: str) -> dict[str, str]:
    # One BLAS/OpenMP thread: each thread reserves address space and counts against RLIMIT_NPROC.
    threads = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    path = os.path.dirname(interpreter())
    return {"PATH": path, "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8", **threads}


def bwrap_command(limits: SandboxLimits, job_fd: int, out_fd: int, seccomp_fd: int | None) -> list[str]:
    """The ``bwrap ... python harness.py`` command line of one sample."""
    command = [shutil.which("bwrap") or "bwrap", *_namespace_args()]
    command += _host_view_args()
    command += ["--ro-bind", HARNESS, _INNER_HARNESS]
    command += ["--proc", "/proc", "--remount-ro", "/proc", "--dev", "/dev", "--remount-ro", "/dev"]
    command += ["--size", str(limits.scratch_mb << 20), "--tmpfs", SCRATCH, "--chdir", SCRATCH]
    command += ["--remount-ro", "/"]  # the root tmpfs: nothing but the scratch dir is writable
    command += ["--clearenv"]
    for key, value in child_env(SCRATCH).items():
        command += ["--setenv", key, value]
    if seccomp_fd is not None:
        command += ["--seccomp", str(seccomp_fd)]
    return [*command, "--", *inner_argv(_INNER_HARNESS, job_fd, out_fd)]


def _namespace_args() -> list[str]:
    args = ["--unshare-user", "--uid", _UID, "--gid", _UID]
    if "--disable-userns" in bwrap_options():  # bwrap >= 0.8; the seccomp filter refuses them too
        args.append("--disable-userns")
    args += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    args += ["--hostname", "sandbox", "--die-with-parent", "--new-session"]
    if os.geteuid() == 0:  # bwrap keeps no capability for a non-root uid; as root say it explicitly
        args += ["--cap-drop", "ALL"]
    return args


@functools.cache
def _host_view_args() -> tuple[str, ...]:
    """Read-only binds of what the interpreter needs: its prefix and the system's shared libraries."""
    args: list[str] = []
    for top in ("/lib", "/lib64", "/lib32", "/libx32"):  # merged /usr: links into /usr
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
    paths = [p for p in ("/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32") if os.path.isdir(p)]
    paths += [p for p in ("/lib", "/lib64") if os.path.isdir(p) and not os.path.islink(p)]
    prefix = os.path.realpath(sys.base_prefix)
    if prefix in ("/", "/usr"):  # a system Python: its binary and stdlib, not all of /usr
        stdlib = sysconfig.get_paths()
        paths += [interpreter(), os.path.realpath(stdlib["stdlib"]), os.path.realpath(stdlib["platstdlib"])]
    else:
        paths.append(prefix)
        if not interpreter().startswith(prefix + os.sep):
            paths.append(interpreter())
    for path in dict.fromkeys(paths):
        if not any(path.startswith(p + os.sep) for p in paths if p != path):
            args += ["--ro-bind", path, path]
    return tuple(args)


@functools.cache
def bwrap_options() -> frozenset[str]:
    """The options this bwrap knows (from ``bwrap --help``)."""
    try:
        done = subprocess.run(["bwrap", "--help"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    return frozenset(word for word in (done.stdout + done.stderr).split() if word.startswith("--"))


@functools.cache
def check_bwrap() -> None:
    """Raise ``SandboxUnavailable`` (one line) unless bwrap is installed and can build the sandbox here."""
    if shutil.which("bwrap") is None:
        raise SandboxUnavailable(
            f"the code sandbox needs bubblewrap, which is not installed: {INSTALL_HINT} "
            "(or SandboxLimits(isolation='none') to run model code without isolation, unsafe)"
        )
    if "--size" not in bwrap_options():
        raise SandboxUnavailable(
            "the code sandbox needs bubblewrap 0.7 or newer (for tmpfs --size); this one is older: "
            "upgrade it (Debian 12, Ubuntu 24.04 and later ship a newer one)"
        )
    command = bwrap_command(SandboxLimits(), 0, 1, None)
    command[command.index("--") + 1 :] = [interpreter(), "-I", "-S", "-c", "pass"]
    try:
        done = subprocess.run(command, capture_output=True, timeout=30, check=False, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as err:
        raise SandboxUnavailable(f"bubblewrap could not start: {err}") from err
    if done.returncode != 0:
        why = " ".join(done.stderr.decode("utf-8", "replace").split())[:200] or f"exit code {done.returncode}"
        raise SandboxUnavailable(
            f"bubblewrap cannot build the code sandbox here ({why}); it needs root or unprivileged user "
            "namespaces (sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0)"
        )


@functools.cache
def warn_no_isolation() -> None:
    """Said once per process, at the first sample run with ``isolation="none"``."""
    logger.warning(
        "sandbox: isolation='none': model-written code runs WITHOUT isolation (a plain child process that "
        "can read and change this machine); use it for trusted code only, not for RL on untrusted outputs"
    )
