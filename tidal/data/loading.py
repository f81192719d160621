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
own errors are often cryptic (an empty JSONL file raises ``StopIteration``).
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

logger = logging.getLogger(__name__)

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


class DataError(ValueError):
    """A dataset could not be loaded or does not have the expected shape; the message says why."""


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
    if len(parts) == 1:
        return parts[0]
    _warn_on_column_mismatch(sources, parts)
    try:
        if weights is None:
            blended = datasets.concatenate_datasets(parts)
        else:
            blended = datasets.interleave_datasets(
                parts, probabilities=weights, seed=seed, stopping_strategy="all_exhausted"
            )
    except (ValueError, TypeError) as err:
        columns = "; ".join(f"{s}: {p.column_names}" for s, p in zip(sources, parts, strict=True))
        raise DataError(f"cannot blend datasets with different columns/types ({columns}): {err}") from err
    return _cap(blended, max_samples)


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
        ds = _load_file(path)
    elif path.is_dir():
        ds = _load_folder(path, split)
    elif _looks_like_file(source):
        raise DataError(f"dataset file not found: {source}")
    else:
        ds = _load_hub(source, split)
    if len(ds) == 0:
        raise DataError(f"dataset {source} is empty (0 rows)")
    return ds


def require_keys(dataset: datasets.Dataset, keys: Iterable[str | None], source: str = "dataset") -> None:
    """Raise ``DataError`` unless every (non-None) key is a column of ``dataset``."""
    columns = list(dataset.column_names)
    for key in keys:
        if key is not None and key not in columns:
            raise DataError(f"key {key!r} not found in {source}; available columns: {columns}")


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
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as err:  # datasets wraps parser errors in several types; report them uniformly
        raise _file_error(path, builder, err) from err


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
