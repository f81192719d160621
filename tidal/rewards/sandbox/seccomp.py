"""A seccomp filter for the sandbox, built with libseccomp (the C library, through ctypes) for bwrap's
``--seccomp FD``.

Everything is allowed except the system calls below, which fail with EPERM (``clone3`` with ENOSYS,
so libc falls back to ``clone``); system calls of another architecture (32-bit ``int 0x80``) kill
the process (libseccomp's default for a foreign architecture). The namespaces already hide the host;
this removes kernel surface the code never needs: tracing other processes, mounting, new namespaces
(``unshare``, ``setns``, and ``clone`` with ``CLONE_NEWUSER``), keyrings, BPF, perf, io_uring,
userfaultfd, modules, file handles that bypass paths.

libseccomp is ``libseccomp2`` on Debian (a dependency of apt and systemd, so nearly always present).
Where it is missing the sandbox runs without the filter and says so once (``filter_program`` is None).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import logging
import os

BLOCKED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "mount", "umount2", "pivot_root",
    "chroot", "unshare", "setns", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount", "fspick",
    "mount_setattr", "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "kexec_load", "kexec_file_load",
    "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff", "open_by_handle_at",
    "name_to_handle_at", "syslog", "acct", "quotactl", "fanotify_init", "settimeofday", "clock_settime",
    "clock_adjtime", "adjtimex", "iopl", "ioperm", "modify_ldt", "uselib", "vhangup", "lookup_dcookie",
)  # fmt: skip
_ACT_ALLOW = 0x7FFF0000
_NR_ERROR = -1  # __NR_SCMP_ERROR: a name this architecture does not have
_CMP_MASKED_EQ = 7  # SCMP_CMP_MASKED_EQ: (arg & datum_a) == datum_b
_CLONE_NEWUSER = 0x10000000


def _act_errno(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)  # SCMP_ACT_ERRNO(code)


@functools.cache
def filter_program() -> bytes | None:
    """The filter as a BPF program (bytes bwrap reads from an fd), or None without libseccomp."""
    lib = _load_libseccomp()
    if lib is None:
        logging.getLogger("tidal.rewards.sandbox").warning(
            "sandbox: libseccomp not found (apt-get install libseccomp2); running without a seccomp filter"
        )
        return None
    ctx = lib.seccomp_init(_ACT_ALLOW)
    if not ctx:
        raise OSError("seccomp_init failed")
    try:
        rules = [(name, errno.EPERM) for name in BLOCKED] + [("clone3", errno.ENOSYS)]
        for name, code in rules:
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number == _NR_ERROR:
                continue
            _add_rule(lib, ctx, _act_errno(code), number, name)
        # clone() that asks for a new user namespace: the other namespaces need capabilities it lacks
        flag = _ArgCmp(0, _CMP_MASKED_EQ, _CLONE_NEWUSER, _CLONE_NEWUSER)
        _add_rule(
            lib, ctx, _act_errno(errno.EPERM), lib.seccomp_syscall_resolve_name(b"clone"), "clone", flag
        )
        fd = os.memfd_create("tidal-seccomp")
        try:
            status = lib.seccomp_export_bpf(ctx, fd)
            if status < 0:
                raise OSError(-status, "seccomp_export_bpf failed")
            os.lseek(fd, 0, os.SEEK_SET)
            return _read_all(fd)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)


class _ArgCmp(ctypes.Structure):
    """libseccomp's ``struct scmp_arg_cmp``: argument ``arg`` compared by ``op`` with the data."""

    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def _add_rule(lib, ctx, action: int, number: int, name: str, *conditions: _ArgCmp) -> None:
    array = (_ArgCmp * len(conditions))(*conditions) if conditions else None
    status = lib.seccomp_rule_add_array(ctx, action, number, len(conditions), array)
    if status < 0:
        raise OSError(-status, f"seccomp_rule_add({name}) failed")


def _load_libseccomp():
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.restype = ctypes.c_int
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    # the non-variadic form of seccomp_rule_add (no argument conditions here)
    lib.seccomp_rule_add_array.restype = ctypes.c_int
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.c_void_p,
    ]
    lib.seccomp_export_bpf.restype = ctypes.c_int
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.restype = None
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def program_fd() -> int | None:
    """A fresh, rewound memfd holding the filter (bwrap reads it once), or None without libseccomp."""
    program = filter_program()
    if program is None:
        return None
    fd = os.memfd_create("tidal-seccomp")
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
