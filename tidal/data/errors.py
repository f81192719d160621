"""``DataError`` for the data modules: defined in ``tidal.config.errors`` (below both the data configs and
``tidal.data``, so neither imports the other to raise it) and re-exported here."""

from tidal.config.errors import DataError as DataError
