"""``DataError``: a dataset could not be loaded or does not have the expected shape.

It lives with the configs, the bottom layer, so that the data configs (``tidal.config.sample_data``,
whose checks raise it) and every data module (``tidal.data``: loading, row naming, samples) can raise
it without an import cycle; ``tidal.data.errors`` re-exports it.
"""


class DataError(ValueError):
    """A dataset could not be loaded or does not have the expected shape; the message says why."""
