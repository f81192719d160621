"""``DataError``: a dataset could not be loaded or does not have the expected shape.

Its own module so that every data module (loading, row naming, samples) can raise it without
importing each other.
"""


class DataError(ValueError):
    """A dataset could not be loaded or does not have the expected shape; the message says why."""
