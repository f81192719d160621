"""CUDA C compiled at run time by NVRTC, for kernels that include no headers (``fp8_decode.cu``).

``load_kernel`` first asks torch (``torch.cuda._compile_kernel``), which needs a CUDA toolkit's include
folder (``CUDA_HOME``). Where there is none (a machine with the driver and a pip-installed torch), it
compiles through NVRTC itself: the library torch's CUDA build depends on (pip's ``nvidia-cuda-nvrtc``,
whose builtins library it loads first, since NVRTC looks for it by name only), and hands the binary to
torch's module loader. ``cubin`` is that second path's compiler alone, which the tests run without a GPU.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch


def _pip_folders(major: str) -> list[Path]:
    """Folders of pip's NVRTC wheels for CUDA ``major``: ``nvidia/cu13/lib`` (13), ``nvidia/cuda_nvrtc/lib``."""
    try:
        import nvidia  # the namespace package of NVIDIA's pip wheels
    except ImportError:
        return []
    roots = [Path(p) for p in nvidia.__path__]
    return [root / sub / "lib" for root in roots for sub in (f"cu{major}", "cuda_nvrtc")]


def nvrtc_library(major: str | None = None) -> ctypes.CDLL:
    """libnvrtc of CUDA ``major`` (torch's by default), found as the process or pip installed it."""
    major = major or (torch.version.cuda or "13").split(".")[0]
    found = None
    for folder in _pip_folders(major):
        for builtins in sorted(folder.glob("libnvrtc-builtins.so.*")):  # before NVRTC looks for it
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
        if found is None and (folder / f"libnvrtc.so.{major}").exists():
            found = folder / f"libnvrtc.so.{major}"
    for name in (f"libnvrtc.so.{major}", str(found) if found else None):
        if name:
            try:
                return ctypes.CDLL(name)
            except OSError:
                continue
    raise OSError(f"no libnvrtc.so.{major} (install nvidia-cuda-nvrtc, or a CUDA toolkit)")


def cubin(source: str, name: str, arch: str, lib: ctypes.CDLL | None = None) -> bytes:
    """The machine code of ``source`` for ``sm_<arch>`` (e.g. "90"); RuntimeError with NVRTC's log."""
    lib = lib or nvrtc_library()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    try:
        options = [f"--gpu-architecture=sm_{arch}".encode(), b"-std=c++17"]
        if lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options)):
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC refused {name}.cu:\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        binary = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, binary)
        return binary.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def load_kernel(source: str, name: str, device: torch.device):
    """The ``extern "C"`` kernel ``name`` of ``source``, loaded on ``device`` (a torch kernel object:
    ``kernel(grid=, block=, args=, shared_mem=)``)."""
    with torch.cuda.device(device):
        try:
            return torch.cuda._compile_kernel(source, name)
        except OSError:  # no CUDA_HOME for torch's include paths: compile without them
            major, minor = torch.cuda.get_device_capability(device)
            binary = cubin(source, name, f"{major}{minor}")
            return torch.cuda._utils._cuda_load_module(binary, [name])[name]
