"""Device/process setup and FSDP2 parallelisation, applied to single-device model code afterwards."""

from tidal.distributed.fsdp import parallelize
from tidal.distributed.weight_sync import engine_weights
from tidal.distributed.world import World, all_reduce_sum, barrier, init_world, shutdown

__all__ = ["World", "engine_weights", "all_reduce_sum", "barrier", "init_world", "parallelize", "shutdown"]
