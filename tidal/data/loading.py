"""Load the ``--dataset`` / ``--prompt_data`` spec into one ``datasets.Dataset``.

A spec is a comma-separated list of sources. Each source is, in this order of precedence:

- a local file: ``.json``, ``.jsonl``, ``.csv``, ``.parquet`` or ``.arrow``;
- a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (``split`` picks the
  split of a ``DatasetDict``);
- a folder of data files (``datasets`` infers the format and the splits from the file names);
- only when it is not an existing local path: a Hugging Face hub dataset name.

``split`` applies to ``DatasetDict`` folders, data-file folders and hub datasets; a single file is
always one split (its whole content). Without ``probs`` the sources are concatenated in order;
``probs`` (``--dataset_probs`` / ``--prompt_data_probs``) blends
the sources with ``datasets.interleave_datasets(stopping_strategy="all_exhausted")``, so smaller
sources are over-sampled until every source has been seen once, as OpenRLHF does. ``max_samples``
caps every source before blending *and* the blended result (OpenRLHF's ``max_count`` semantics).

Every failure is a ``DataError`` naming the source (and line/row/key where relevant): ``datasets``'
own errors are often cryptic (an empty JSONL file raises ``StopIteration``, a non-UTF-8 line a
``UnicodeDecodeError`` only when the row is read). The loaded dataset remembers which file and row
each of its rows came from (``tidal.data.rows.row_name``).

JSON values keep their types as written: where one column mixes types (a label ``7`` among labels
``"8"``), ``datasets`` stores it as a ``Json`` column that decodes the *string* ``"8"`` to the number
8, so a reward function comparing strings scored 0 on every row. Such columns are re-read from the
file with Python's ``json`` (strings stay strings, numbers stay numbers).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
from collections.abc import Iterable, Iterator
from pathlib import Path
from urllib.parse import urlparse

import datasets
import numpy as np

from tidal.data.errors import DataError
from tidal.data.rows import RowOrigins, register_origins
from tidal.data.rows import require_keys as require_keys  # defined with the other row checks

logger = logging.getLogger(__name__)

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


def load_dataset_spec(
    spec: str,
    probs: str | None = None,
    split: str = "train",
    max_samples: int | None = None,
    seed: int = 42,
) -> datasets.Dataset:
    """Load and blend the comma-separated sources of ``spec`` into one dataset (see module doc)."""
    sources = [s.strip() for s in spec.split(",") if s.strip()]
    if not sources:
        raise DataError(
            f"empty dataset spec {spec!r}: expected a path or hub name (comma-separated for several)"
        )
    weights = parse_probs(probs, len(sources)) if probs else None
    parts = [_cap(load_source(src, split), max_samples) for src in sources]
    starts = tuple(int(x) for x in np.cumsum([0] + [len(p) for p in parts[:-1]]))
    if len(parts) == 1:
        return register_origins(parts[0], RowOrigins(tuple(sources), starts))
    _warn_on_column_mismatch(sources, parts)
    parts = _align_json_columns(parts)
    index = None
    try:
        if weights is None:
            blended = datasets.concatenate_datasets(parts)
        else:
            # Tag rows with their position in the concatenation to know where each blended row came from.
            tagged = [
                p.add_column(_ORIGIN_COLUMN, range(a, a + len(p))) for p, a in zip(parts, starts, strict=True)
            ]
            blended = datasets.interleave_datasets(
                tagged, probabilities=weights, seed=seed, stopping_strategy="all_exhausted"
            )
            index = np.asarray(blended[_ORIGIN_COLUMN])
            blended = blended.remove_columns(_ORIGIN_COLUMN)
    except (ValueError, TypeError) as err:
        columns = "; ".join(f"{s}: {p.column_names}" for s, p in zip(sources, parts, strict=True))
        raise DataError(f"cannot blend datasets with different columns/types ({columns}): {err}") from err
    capped = _cap(blended, max_samples)
    if index is not None:
        index = index[: len(capped)]
    return register_origins(capped, RowOrigins(tuple(sources), starts, index))


_ORIGIN_COLUMN = "__tidal_origin_row__"


def _warn_on_column_mismatch(sources: list[str], parts: list[datasets.Dataset]) -> None:
    # datasets fills a column missing from one source with None; that is fine for extra metadata
    # columns, but a renamed key only surfaces later as "row N has no value for key", so say it now.
    if len({tuple(sorted(p.column_names)) for p in parts}) > 1:
        columns = "; ".join(f"{s}: {p.column_names}" for s, p in zip(sources, parts, strict=True))
        logger.warning("blended datasets have different columns (missing ones become None): %s", columns)


def parse_probs(probs: str | Iterable[float], n_sources: int) -> list[float]:
    """Parse ``--dataset_probs`` ("0.1,0.4,0.5"): one weight per source, non-negative, summing to ~1."""
    try:
        weights = (
            [float(p) for p in probs.split(",")] if isinstance(probs, str) else [float(p) for p in probs]
        )
    except ValueError as err:
        raise DataError(f"--dataset_probs {probs!r} is not a comma-separated list of numbers") from err
    if len(weights) != n_sources:
        raise DataError(
            f"--dataset_probs has {len(weights)} value(s) but --dataset names {n_sources} source(s); "
            "give one probability per dataset"
        )
    if any(w < 0 for w in weights) or abs(sum(weights) - 1.0) > 1e-3:
        raise DataError(
            f"--dataset_probs {probs!r} must be non-negative and sum to 1 (sum={sum(weights):.4f})"
        )
    return weights


def load_source(source: str, split: str = "train") -> datasets.Dataset:
    """Load one source: a local file, a ``save_to_disk`` folder, a data folder, or a hub name."""
    path = Path(source).expanduser()
    if path.is_file():
        with _quiet_progress():
            ds = _load_file(path)
    elif path.is_dir():
        with _quiet_progress():
            ds = _load_folder(path, split)
    elif _looks_like_file(source):
        raise DataError(f"dataset file not found: {source}")
    else:
        ds = _load_hub(source, split)
    if len(ds) == 0:
        raise DataError(f"dataset {source} is empty (0 rows)")
    return ds


def _cap(ds: datasets.Dataset, max_samples: int | None) -> datasets.Dataset:
    if max_samples is None or max_samples < 0 or len(ds) <= max_samples:
        return ds
    return ds.select(range(max_samples))


def _looks_like_file(source: str) -> bool:
    """A name with a data-file extension or a path separator is a missing path, not a hub name."""
    return (
        Path(source).suffix.lower() in FILE_BUILDERS
        or source.startswith((".", "/", "~"))
        or source.count("/") > 1
    )


def _load_file(path: Path) -> datasets.Dataset:
    builder = FILE_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DataError(
            f"unsupported dataset file extension {path.suffix!r} for {path}; "
            f"expected one of {sorted(FILE_BUILDERS)} or a folder"
        )
    if path.stat().st_size == 0:
        raise DataError(f"dataset file {path} is empty")
    if builder in ("json", "csv"):
        check_utf8(path)
    try:
        ds = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as err:  # datasets wraps parser errors in several types; report them uniformly
        raise _file_error(path, builder, err) from err
    return keep_json_types(ds, path) if builder == "json" else ds


def check_utf8(path: Path) -> None:
    """A ``DataError`` naming the first line of ``path`` that is not valid UTF-8."""
    with path.open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{path} line {lineno} is not valid UTF-8 (byte {line[err.start]:#04x} at column "
                    f"{err.start + 1}); save the file as UTF-8"
                ) from err


def _is_mixed_json_column(feature) -> bool:
    return isinstance(feature, datasets.Json)


def keep_json_types(ds: datasets.Dataset, path: Path) -> datasets.Dataset:
    """Re-read the columns ``datasets`` could not type (mixed types) so each value is as written."""
    mixed = [name for name, feature in ds.features.items() if _is_mixed_json_column(feature)]
    if not mixed:
        return ds
    records = read_json_records(path)
    if len(records) != len(ds):  # not the row-per-record layout assumed here: leave datasets' reading
        return ds
    for name in mixed:
        ds = as_json_column(ds, name, [r.get(name) for r in records])
    return ds


def as_json_column(ds: datasets.Dataset, name: str, values: list) -> datasets.Dataset:
    """``ds`` with column ``name`` replaced by ``values`` in a ``Json`` column that decodes them as given."""
    # The Json feature stores JSON text; encoding every value ourselves keeps "8" a string.
    encoded = [None if v is None else json.dumps(v) for v in values]
    # Added before the old column goes: a table left with no column would have no rows.
    order, temporary = list(ds.column_names), f"{name}__tidal_json"
    ds = ds.add_column(temporary, encoded, feature=datasets.Json())
    return ds.remove_columns(name).rename_column(temporary, name).select_columns(order)


def _align_json_columns(parts: list[datasets.Dataset]) -> list[datasets.Dataset]:
    """A column of mixed types in one source (``Json``) is made ``Json`` in every source, so they blend."""
    mixed = {n for p in parts for n, f in p.features.items() if _is_mixed_json_column(f)}
    aligned = []
    for part in parts:
        for name in mixed:
            if name in part.column_names and not _is_mixed_json_column(part.features[name]):
                part = as_json_column(part, name, list(part[name]))
        aligned.append(part)
    return aligned


def read_json_records(path: Path) -> list[dict]:
    """The records of a JSON array or JSON-lines file, as Python's ``json`` reads them."""
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _file_error(path: Path, builder: str, err: Exception) -> DataError:
    """Turn a ``datasets`` load failure into a message naming the file (and the bad JSON line)."""
    if builder == "json":
        where = find_json_error(path)
        if where:
            return DataError(f"malformed JSON in {path}: {where}")
    # datasets reports an empty file as StopIteration (JSON) or "corresponds to no data" (CSV header only)
    if isinstance(err, StopIteration) or "corresponds to no data" in str(err):
        return DataError(f"dataset file {path} has no rows")
    cause = err.__cause__ or err.__context__ or err
    return DataError(f"cannot read {builder} file {path}: {type(cause).__name__}: {cause}")


def find_json_error(path: Path) -> str | None:
    """Locate the first malformed record of a JSON array or JSON-lines file ("line N: reason")."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if text.lstrip().startswith("["):  # one JSON document: json's own error has line and column
        try:
            json.loads(text)
        except json.JSONDecodeError as err:
            return f"line {err.lineno} column {err.colno}: {err.msg}"
        return None
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            return f"line {lineno}: {err.msg} (column {err.colno}): {line.strip()[:80]!r}"
        if not isinstance(record, dict):
            return f"line {lineno}: expected a JSON object per line, got {type(record).__name__}"
    return None


def _load_folder(path: Path, split: str) -> datasets.Dataset:
    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        try:
            loaded = datasets.load_from_disk(str(path))
        except Exception as err:
            raise DataError(f"cannot read save_to_disk folder {path}: {err}") from err
    else:
        try:
            loaded = datasets.load_dataset(str(path))
        except Exception as err:
            raise DataError(f"cannot load data files in folder {path}: {type(err).__name__}: {err}") from err
    return _pick_split(loaded, split, str(path))


def _pick_split(loaded, split: str, source: str) -> datasets.Dataset:
    if isinstance(loaded, datasets.Dataset):
        return loaded
    if split not in loaded:
        raise DataError(f"split {split!r} not found in {source}; available splits: {sorted(loaded)}")
    return loaded[split]


def _load_hub(name: str, split: str) -> datasets.Dataset:
    # Without a network, datasets retries for ~25 s before failing; check reachability first and,
    # when the hub is unreachable, still allow a copy already in the local cache.
    offline = datasets.config.HF_HUB_OFFLINE or not _hub_reachable()
    try:
        with _offline_mode(offline):
            loaded = datasets.load_dataset(name, split=split)
    except Exception as err:
        state = "the hub is unreachable (offline)" if offline else "the hub could not load it"
        raise DataError(
            f"dataset {name!r} is neither an existing local path nor loadable from the Hugging Face hub "
            f"({state}: {type(err).__name__}: {err})"
        ) from err
    return _pick_split(loaded, split, name)


def _hub_reachable(timeout: float = 3.0) -> bool:
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """No ``datasets`` progress bars ("Generating train split", "Map") while a local source is read, at
    tidal's default log level: start-up noise that says nothing about the user's run (a local file
    converts in seconds). With the ``tidal`` logger at DEBUG, or bars already off, nothing changes."""
    if not datasets.is_progress_bar_enabled() or logging.getLogger("tidal").isEnabledFor(logging.DEBUG):
        yield
        return
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.enable_progress_bars()


@contextlib.contextmanager
def _offline_mode(enabled: bool) -> Iterator[None]:
    """Temporarily switch ``datasets`` and ``huggingface_hub`` to offline mode (cache only)."""
    if not enabled:
        yield
        return
    import huggingface_hub.constants as hub_constants

    saved = datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved
