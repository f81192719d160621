"""Test spies: a function patched to record its calls and still do its work."""

from __future__ import annotations


def count_calls(monkeypatch, owner, name: str) -> list:
    """Patch ``owner.<name>`` (a module's or class's function) to record each call's positional arguments
    before running the real one; returns the record, a list that grows as the calls happen."""
    calls, real = [], getattr(owner, name)

    def recorded(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, recorded)
    return calls
