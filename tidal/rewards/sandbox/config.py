"""The sandbox's small types: a stdin/stdout test case, the limits of one sample, its result, statuses."""

from __future__ import annotations

from dataclasses import dataclass

# Statuses that score by fraction passed; every other status scores 0.
SCORED_STATUSES = ("passed", "failed")
STATUSES = SCORED_STATUSES + (
    "no_code",
    "syntax_error",
    "error",
    "timeout",
    "memory",
    "output_limit",
    "file_limit",
    "forbidden",
    "crashed",
    "sandbox_error",
)
ISOLATIONS = ("bwrap", "none")


class SandboxUnavailable(RuntimeError):
    """The isolation the limits ask for cannot run here (bubblewrap missing or refused); nothing ran."""


@dataclass(frozen=True)
class TestCase:
    """One stdin -> stdout test: the program's output must equal ``stdout`` up to trailing whitespace."""

    __test__ = False  # not a pytest test class

    stdin: str = ""
    stdout: str = ""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sample. ``cpu_s`` defaults to the wall timeout rounded up.

    ``max_processes`` bounds the sample's processes (the harness's included); ``max_file_mb`` one
    file; ``scratch_mb`` the whole private scratch filesystem. ``isolation="bwrap"`` (the default)
    runs the code in a bubblewrap sandbox and refuses to run without it; ``"none"`` is the explicit,
    unsafe opt-out (a plain child process, a warning at first use): for trusted code only."""

    timeout_s: float = 10.0
    memory_mb: int = 1024
    max_output_bytes: int = 1 << 20
    cpu_s: int | None = None
    max_processes: int = 16
    max_file_mb: int = 16
    max_open_files: int = 64
    scratch_mb: int = 64
    isolation: str = "bwrap"

    def __post_init__(self) -> None:
        for name in (
            "timeout_s",
            "memory_mb",
            "max_output_bytes",
            "max_processes",
            "max_file_mb",
            "max_open_files",
            "scratch_mb",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox limit {name}={getattr(self, name)!r}; expected a positive number")
        if self.cpu_s is not None and self.cpu_s <= 0:
            raise ValueError(f"sandbox limit cpu_s={self.cpu_s!r}; expected a positive number or None")
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"sandbox isolation={self.isolation!r}; expected one of {', '.join(ISOLATIONS)}")


@dataclass(frozen=True)
class SandboxResult:
    """``passed`` of ``total`` tests, a ``status`` from ``STATUSES`` and a one-line ``message``."""

    passed: int
    total: int
    status: str
    message: str = ""

    @property
    def score(self) -> float:
        """Fraction of tests passed, in [0, 1]; 0 for every failure of the sample as a whole."""
        if self.status not in SCORED_STATUSES or self.total <= 0:
            return 0.0
        return min(max(self.passed, 0), self.total) / self.total
