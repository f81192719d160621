"""``tidal serve``'s flags live in the light ``tidal.config.serve`` (so ``--help`` loads no torch);
re-exported here, where the server's other modules are."""

from tidal.config.serve import UNUSED_MODEL_FLAGS as UNUSED_MODEL_FLAGS
from tidal.config.serve import ServeConfig as ServeConfig
