"""Thin command-line entry points: ``tidal <command>`` and ``python -m tidal.cli.<module>``."""
