"""Triton kernels run on the CPU by Triton's interpreter (``TRITON_INTERPRET=1``), for the kernel tests'
CPU fixtures. Skipped where CUDA runs the compiled kernels (the gpu tests cover them there) or where
triton is not installed (CI); with triton on a CPU machine they check the kernels' logic on small shapes.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator

import pytest
import torch


class NumpyLibdevice:
    """Stands in for a kernel module's ``libdevice`` under the interpreter (which has none): ``tl.log`` and
    ``tl.exp`` are looked up at each call, when the interpreter has patched them to numpy's float32
    functions. Patch it in with ``monkeypatch.setattr(module, "libdevice", NumpyLibdevice)``."""

    @staticmethod
    def log(x):
        import triton.language as tl

        return tl.log(x)

    @staticmethod
    def exp(x):
        import triton.language as tl

        return tl.exp(x)


@contextlib.contextmanager
def interpreted(kernels: dict[str, str]) -> Iterator[list]:
    """The modules named by ``kernels`` (module name -> one of its ``@triton.jit`` kernels), in order, with
    their kernels interpreted: a module imported before ``TRITON_INTERPRET`` was set holds compiled-mode
    kernels, so it is re-imported (a later module that imports an earlier one's kernels comes after it)."""
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the gpu tests run the compiled kernels")
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # read when a module's @triton.jit runs
    try:
        try:
            import triton.runtime.interpreter as interpreter
        except ImportError:
            pytest.skip("triton is not installed")
        _interpret_standard_library(interpreter)
        _index_scalars_of_one_element(interpreter)
        modules, reloaded = [], False
        for name, kernel in kernels.items():
            module = importlib.import_module(name)
            # after an earlier module's reload, a later one re-imports that module's new kernels
            if reloaded or not isinstance(getattr(module, kernel), interpreter.InterpretedFunction):
                module, reloaded = importlib.reload(module), True
            modules.append(module)
        yield modules
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = previous


# Exact mode's kernel modules, in import order (``triton_exact`` re-exports the other two's functions).
EXACT_KERNELS = {
    "tidal.rollout.kernels.triton_exact_rows": "_rms_norm_kernel",
    "tidal.rollout.kernels.triton_exact_attention": "_attention_kernel",
    "tidal.rollout.kernels.triton_exact": "_matmul_kernel",
}


def _interpret_standard_library(interpreter) -> None:
    """``tl.sum``/``tl.max``/... are ``@triton.jit`` functions of ``triton.language.standard``, made when
    triton is first imported: if that was before ``TRITON_INTERPRET=1`` (another test imported triton),
    they are compiled-mode functions the interpreter cannot call. Re-make them interpreted."""
    import triton.language as tl

    if not isinstance(tl.standard.sum, interpreter.InterpretedFunction):
        importlib.reload(tl.standard)
        importlib.reload(tl)


def _index_scalars_of_one_element(interpreter) -> None:
    """triton 3.6's interpreter holds a scalar as a 1-element array and makes ``range`` bounds of it with
    ``int(array)``, which numpy >= 2.4 refuses for 1-d arrays; read its one element instead."""
    if getattr(interpreter, "_tidal_patched", False):
        return
    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch
    interpreter._tidal_patched = True
