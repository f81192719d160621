"""Name dataset rows by the file they came from, and check text columns of a whole dataset at once.

``load_dataset_spec`` blends several files into one ``datasets.Dataset``; an error about "row 73" of
the blend says nothing to the user. ``register_origins`` records, for a loaded dataset, which source
and which 1-based row of it each row came from, and ``row_name`` turns an index of that dataset
into "row 41 of prompts.jsonl" (datasets it did not load are named by index, 1-based, and the spec).

``check_text_columns`` runs before any sample is built (and so before any model loads): it reads the
prompt/response columns of every row and reports the first few bad rows together (missing value,
wrong type, empty prompt) in one line, instead of failing on the first one, or at a rollout that
meets an empty prompt hours later.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tidal.data.errors import DataError

if TYPE_CHECKING:  # annotations only: importing datasets (with pandas, pyarrow) costs a second per process
    import datasets

MAX_REPORTED_ROWS = 5


@dataclass(frozen=True)
class RowOrigins:
    """Where each row of a loaded dataset came from.

    The sources are concatenated in order (``starts[k]`` is the first row of source ``k``);
    ``index`` maps a row of the (blended, capped) dataset to its row in that concatenation, or is
    ``None`` when the two are the same.
    """

    sources: tuple[str, ...]
    starts: tuple[int, ...]
    index: np.ndarray | None = None

    def locate(self, row: int) -> tuple[str, int]:
        """``(source, 1-based row in it)`` of row ``row``."""
        flat = int(self.index[row]) if self.index is not None else row
        k = bisect.bisect_right(self.starts, flat) - 1
        return self.sources[k], flat - self.starts[k] + 1


# Keyed by the dataset object: a dataset derived from it (shuffled, selected) is not named by file.
_ORIGINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def register_origins(dataset: datasets.Dataset, origins: RowOrigins) -> datasets.Dataset:
    _ORIGINS[dataset] = origins
    return dataset


def require_keys(dataset: datasets.Dataset, keys: Iterable[str | None], source: str = "dataset") -> None:
    """Raise ``DataError`` unless every (non-None) key is a column of ``dataset``."""
    columns = list(dataset.column_names)
    for key in keys:
        if key is not None and key not in columns:
            raise DataError(f"key {key!r} not found in {source}; available columns: {columns}")


def row_name(dataset: datasets.Dataset | None, row: int, source: str = "dataset") -> str:
    """``"row 41 of prompts.jsonl"``: the file and 1-based row when known, else the 1-based index."""
    origins = _ORIGINS.get(dataset) if dataset is not None else None
    if origins is None:
        return f"row {row + 1} of {source}"
    file, line = origins.locate(row)
    return f"row {line} of {file}"


def row_source(dataset: datasets.Dataset | None, row: int) -> str | None:
    """The source (file, folder or hub name as given) row ``row`` came from, if known; files a row
    names (its images) are read relative to it."""
    origins = _ORIGINS.get(dataset) if dataset is not None else None
    return origins.locate(row)[0] if origins is not None else None


def text_problem(value: Any, chat: bool, non_empty: bool) -> str | None:
    """Why ``value`` cannot be a prompt/response (``None`` if it can): text, or messages with ``chat``."""
    if value is None:
        return "has no value"
    if isinstance(value, str):
        return "is empty" if non_empty and not value.strip() else None
    if isinstance(value, list):
        if not chat:
            return "is a list of messages: pass --apply_chat_template"
        if not all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
            return f"is not a list of {{'role', 'content'}} messages: {str(value)[:60]!r}"
        if non_empty and not any(_has_content(m["content"]) for m in value):
            return "has no non-empty message"
        return None
    expected = "a string or a list of messages" if chat else "a string"
    return f"is a {type(value).__name__} ({str(value)[:40]!r}), expected {expected}"


def _has_content(content: Any) -> bool:
    """A message's content is text, or content parts (OpenRLHF's image rows) with an image or some text."""
    if isinstance(content, str):
        return bool(content.strip())
    if isinstance(content, list):
        return any(
            isinstance(p, dict) and (p.get("type") == "image" or str(p.get("text") or "").strip())
            for p in content
        )
    return False


def check_text_columns(
    dataset: datasets.Dataset,
    keys: Sequence[str | None],
    source: str,
    chat: bool,
    non_empty: Sequence[str | None] = (),
) -> None:
    """Raise one ``DataError`` naming the first bad rows (file and 1-based row) of the ``keys`` columns.

    ``non_empty``: keys whose text must not be empty (prompts a model generates from)."""
    problems: list[tuple[int, str]] = []
    for key in dict.fromkeys(k for k in keys if k is not None):
        for i, value in enumerate(dataset[key]):
            problem = text_problem(value, chat, key in non_empty)
            if problem:
                problems.append((i, f"key {key!r} {problem}"))
    if not problems:
        return
    problems.sort(key=lambda p: p[0])
    shown = "; ".join(f"{row_name(dataset, i, source)}: {p}" for i, p in problems[:MAX_REPORTED_ROWS])
    more = len(problems) - MAX_REPORTED_ROWS
    tail = f"; and {more} more" if more > 0 else ""
    raise DataError(f"{len(problems)} bad row(s) in {source}: {shown}{tail}")
