"""Package ``__init__``s whose names are imported on first use (PEP 562 module ``__getattr__``).

Every tidal process imports some package: a rollout engine process needs ``tidal.data.batching`` but
not ``datasets``, a weight-sync helper needs ``tidal.distributed.weight_sync`` but not FSDP. A package
whose ``__init__`` imports all of its submodules makes each of those imports pay for the whole package
(seconds of torch.distributed, ``datasets`` and pandas start-up per process). With ``lazy_exports`` the
package keeps its public names (``from tidal.data import load_source`` still works) and imports a
submodule only when one of its names is first used.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list]]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps each public name to the submodule that
    defines it. A name is imported once, then kept on the package (later lookups are plain attributes);
    a submodule's own name (``tidal.data.loading``) imports that submodule, as an eager ``__init__`` did."""

    def __getattr__(name: str) -> object:
        if name.startswith("__"):  # e.g. ``__wrapped__`` probed by inspect: never a submodule
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
        else:
            try:
                value = importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as err:
                if err.name != f"{package}.{name}":
                    raise  # the submodule exists but one of its own imports is missing
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
