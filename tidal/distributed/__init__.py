"""Device/process setup and FSDP2 parallelisation, applied to single-device model code afterwards."""

from typing import TYPE_CHECKING

from tidal.lazy import lazy_exports

if TYPE_CHECKING:  # the same names for type checkers, and for tests/test_imports.py's import graph
    from tidal.distributed.fsdp import parallelize
    from tidal.distributed.weight_sync import engine_weights
    from tidal.distributed.world import World, all_reduce_sum, barrier, init_world, shutdown

# name → the submodule that defines it, imported when the name is first used (see tidal.lazy)
_EXPORTS = {
    "World": "tidal.distributed.world",
    "all_reduce_sum": "tidal.distributed.world",
    "barrier": "tidal.distributed.world",
    "engine_weights": "tidal.distributed.weight_sync",
    "init_world": "tidal.distributed.world",
    "parallelize": "tidal.distributed.fsdp",
    "shutdown": "tidal.distributed.world",
}

__all__ = ["World", "engine_weights", "all_reduce_sum", "barrier", "init_world", "parallelize", "shutdown"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
