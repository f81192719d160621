"""Process-reward-model samples: text whose reasoning steps end in a step marker, one label per step.

Rows follow OpenRLHF's ``ProcessRewardDataset`` (Math-Shepherd style): ``--input_key`` holds the text
with ``--placeholder_token`` (e.g. ``ки``) after every step, ``--label_key`` a list with one label per
marker. The text is rendered like a prompt (``--input_template`` / ``--apply_chat_template``, see
``tidal.data.templates``) and tokenized once; the marker must be a single token of the tokenizer.

Labels are either

- hard: strings, each one of ``--reward_tokens`` (stored as its index), or, without
  ``--reward_tokens``, any single token (stored as its token id; the loss then spans the vocabulary);
- soft: numbers in [0, 1], the probability that the step is good, i.e. of the first reward token
  (needs exactly two ``--reward_tokens``, e.g. ``+ -``).

A row whose marker count differs from its label count is an error naming the row (OpenRLHF silently
truncates); rows longer than ``max_len`` tokens are skipped and counted, never truncated.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tidal.config.sample_data import PRMDataConfig
from tidal.data.collate import collate_packed, collate_padded
from tidal.data.errors import DataError
from tidal.data.rows import check_text_columns, require_keys, row_name
from tidal.data.sft import SFTSample, SkipStats
from tidal.data.templates import render_prompt, tokenize_texts

if TYPE_CHECKING:  # annotations only: importing datasets (with pandas, pyarrow) costs a second per process
    import datasets


@dataclass
class PRMSample:
    input_ids: list[int]
    step_positions: list[int]  # indices of the step-marker tokens
    step_labels: list[int] | list[float]  # per step: reward-token index/id (hard) or P(good) (soft)
    row: int = -1

    def __len__(self) -> int:
        return len(self.input_ids)


def single_token_id(tokenizer, text: str, flag: str) -> int:
    """The id of ``text`` if the tokenizer encodes it as exactly one token, else a ``DataError``."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise DataError(
            f"{flag} {text!r} is {len(ids)} tokens for this tokenizer; it must be exactly one token"
        )
    return ids[0]


def reward_token_ids(tokenizer, cfg: PRMDataConfig) -> list[int] | None:
    """Token ids of ``--reward_tokens`` (None: the loss uses the whole vocabulary)."""
    if cfg.reward_tokens is None:
        return None
    return [single_token_id(tokenizer, t, "--reward_tokens") for t in cfg.reward_tokens]


def build_prm_samples(
    dataset: datasets.Dataset, tokenizer, cfg: PRMDataConfig, source: str = "dataset"
) -> tuple[list[PRMSample], SkipStats]:
    """Render, tokenize and label every row; return the kept samples and what was skipped."""
    cfg.validate()
    require_keys(dataset, [cfg.input_key, cfg.label_key], source)
    check_text_columns(dataset, [cfg.input_key], source, cfg.apply_chat_template)
    marker = single_token_id(tokenizer, cfg.placeholder_token, "--placeholder_token")
    reward_ids = reward_token_ids(tokenizer, cfg)
    texts = [_render(row, row_name(dataset, i, source), tokenizer, cfg) for i, row in enumerate(dataset)]
    encoded = tokenize_texts(tokenizer, texts, cfg.apply_chat_template)["input_ids"]
    samples, stats = [], SkipStats()
    for i, (ids, raw) in enumerate(zip(encoded, dataset[cfg.label_key], strict=True)):
        try:
            labels = _labels(raw, tokenizer, cfg, reward_ids)
            positions = [t for t, token in enumerate(ids) if token == marker]
            if len(positions) != len(labels):
                raise DataError(
                    f"{len(positions)} {cfg.placeholder_token!r} step marker(s) but {len(labels)} label(s)"
                )
            if positions and positions[0] == 0:
                raise DataError("the text starts with a step marker; nothing precedes the first step")
        except DataError as err:
            raise DataError(f"{row_name(dataset, i, source)}: {err}") from err
        if len(ids) > cfg.max_len:
            stats.add("too_long", i)
        elif not positions:
            stats.add("no_target", i)
        else:
            samples.append(PRMSample(list(ids), positions, labels, row=i))
    if not samples:
        raise DataError(f"no usable PRM sample in {source} ({stats.summary()}); check --max_len and the keys")
    return samples, stats


def _render(row: dict, where: str, tokenizer, cfg: PRMDataConfig) -> str:
    if row[cfg.input_key] is None:
        raise DataError(f"{where} has no value for key {cfg.input_key!r}")
    try:
        return render_prompt(row[cfg.input_key], tokenizer, cfg.input_template, cfg.apply_chat_template)
    except DataError as err:
        raise DataError(f"{where}: {err}") from err


def _labels(raw: Any, tokenizer, cfg: PRMDataConfig, reward_ids) -> list:
    """One row's labels (Arrow columns have one type, so every row has the same kind of labels)."""
    if not isinstance(raw, list) or not raw:
        raise DataError(f"{cfg.label_key!r} must be a non-empty list with one label per step, got {raw!r}")
    if not isinstance(raw[0], str):
        return _soft_labels(raw, cfg)
    if not all(isinstance(x, str) for x in raw):
        raise DataError(f"hard labels must all be strings, got {raw!r}")
    if reward_ids is None:
        return [single_token_id(tokenizer, x, f"label {cfg.label_key!r}") for x in raw]
    unknown = [x for x in raw if x not in cfg.reward_tokens]
    if unknown:
        raise DataError(f"label(s) {unknown} are not among --reward_tokens {cfg.reward_tokens}")
    return [cfg.reward_tokens.index(x) for x in raw]


def _soft_labels(raw: list, cfg: PRMDataConfig) -> list[float]:
    if cfg.reward_tokens is None or len(cfg.reward_tokens) != 2:
        raise DataError(
            "soft (number) labels need exactly two --reward_tokens, the good one first (e.g. + -)"
        )
    bad = [x for x in raw if isinstance(x, bool) or not isinstance(x, numbers.Real) or not 0 <= x <= 1]
    if bad:
        raise DataError(f"soft labels must be numbers in [0, 1], got {bad}")
    return [float(x) for x in raw]


def collate_prm(samples: list[PRMSample], pad_id: int, packing: bool = False) -> dict[str, torch.Tensor]:
    """Padded ``[B, T]`` or packed ``[1, ΣT]`` tensors (``tidal.data.collate`` layouts) plus
    ``placeholder_mask`` and ``labels`` (long for hard labels, float for soft; 0 off the markers)."""
    if not samples:
        raise ValueError("cannot collate an empty micro-batch of PRM samples")
    as_sft = [SFTSample(s.input_ids, [0] * len(s), s.row) for s in samples]
    batch = collate_packed(as_sft) if packing else collate_padded(as_sft, pad_id)
    del batch["loss_mask"]
    soft = isinstance(samples[0].step_labels[0], float)
    shape = batch["input_ids"].shape
    mask = torch.zeros(shape, dtype=torch.bool)
    labels = torch.zeros(shape, dtype=torch.float32 if soft else torch.long)
    offset = 0
    for row, s in enumerate(samples):
        r, base = (0, offset) if packing else (row, 0)
        positions = torch.tensor(s.step_positions) + base
        mask[r, positions] = True
        labels[r, positions] = torch.tensor(s.step_labels, dtype=labels.dtype)
        offset += len(s)
    batch["placeholder_mask"], batch["labels"] = mask, labels
    return batch
