"""Pairwise preference samples (chosen vs. rejected) for reward-model and DPO-family training.

Rows hold ``--chosen_key`` and ``--rejected_key`` (strings or chat-message lists), optionally a
``--prompt_key`` and a numeric ``margin`` column (the RM loss's margin with ``--margin_loss``, as
Llama 2; a missing value is 0, or a ``DataError`` naming the row with ``require_margin``). Rendering
follows OpenRLHF's ``RewardDataset``:

- with ``--prompt_key``: the prompt is rendered as in SFT (``render_prompt``: chat template, input
  template or as is) and each side is the response that follows it (``render_response``: the
  assistant turn, or ``response + eos`` without a chat template);
- without it and with ``--apply_chat_template``: each side is a whole conversation; its prompt is the
  conversation before the final assistant message, rendered with the generation prompt;
- without either: each side is plain text (``+ eos``) with no prompt.

Each pair becomes a ``PairSample``: the token ids of the chosen and rejected full sequences and
``prompt_len``, the number of leading tokens (shared by both sides) that carry only prompt text, so
DPO can mask them. A token straddling the prompt/response boundary counts as response, and the
smaller of the two sides' prompt lengths is kept, so no response token is ever masked. Pairs with a
side longer than ``max_len`` tokens, or a side without a response token, are skipped and counted in
``SkipStats``, never truncated.

``collate_pairs`` puts the chosen rows first, then the rejected ones: padded ``[2B, T]`` with
``attention_mask``, ``position_ids`` and a ``loss_mask`` of response tokens (same convention as
``tidal.data.collate``), or packed into one row with ``segment_ids``/``position_ids``/``seq_lens``/
``cu_seqlens``; both carry ``margin`` ``[B]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tidal.config.sample_data import PairDataConfig
from tidal.data.collate import collate_packed, collate_padded
from tidal.data.errors import DataError
from tidal.data.rows import check_text_columns, require_keys, row_name
from tidal.data.sft import SFTSample, SkipStats
from tidal.data.templates import as_messages, chat_text, render_prompt, render_response, tokenize_texts

if TYPE_CHECKING:  # annotations only: importing datasets (with pandas, pyarrow) costs a second per process
    import datasets

MARGIN_COLUMN = "margin"


@dataclass
class PairSample:
    chosen_ids: list[int]
    rejected_ids: list[int]
    prompt_len: int  # leading tokens of both sides that are prompt only (never trained by DPO)
    margin: float = 0.0
    row: int = -1  # index of the dataset row it came from, for error messages
    images: Any = None  # the prompt's images (tidal.data.vision.SampleImages), for vision-language models


def build_pair_samples(
    dataset: datasets.Dataset,
    tokenizer,
    cfg: PairDataConfig,
    source: str = "dataset",
    batch_size: int = 1024,
    require_margin: bool = False,
) -> tuple[list[PairSample], SkipStats]:
    """Render and tokenize every pair; return the kept samples and what was skipped. With
    ``require_margin`` every row must have a numeric ``margin``."""
    cfg.validate()
    require_keys(dataset, [cfg.prompt_key, cfg.chosen_key, cfg.rejected_key], source)
    check_text_columns(
        dataset, [cfg.prompt_key, cfg.chosen_key, cfg.rejected_key], source, cfg.apply_chat_template
    )
    margins = _margins(dataset, source, require_margin)
    samples: list[PairSample] = []
    stats = SkipStats()
    for start in range(0, len(dataset), batch_size):
        rows = range(start, min(start + batch_size, len(dataset)))
        rendered = [_render_row(dataset[i], row_name(dataset, i, source), tokenizer, cfg) for i in rows]
        chosen = _encode(tokenizer, [c for c, _, _, _ in rendered], cfg.apply_chat_template)
        rejected = _encode(tokenizer, [r for _, r, _, _ in rendered], cfg.apply_chat_template)
        for k, i in enumerate(rows):
            _, _, c_prompt, r_prompt = rendered[k]
            c_ids, r_ids = chosen["input_ids"][k], rejected["input_ids"][k]
            prompt_len = min(
                _prompt_tokens(chosen["offset_mapping"][k], c_prompt),
                _prompt_tokens(rejected["offset_mapping"][k], r_prompt),
            )
            if max(len(c_ids), len(r_ids)) > cfg.max_len:
                stats.add("too_long", i)
            elif prompt_len >= min(len(c_ids), len(r_ids)):
                stats.add("no_target", i)
            else:
                samples.append(PairSample(list(c_ids), list(r_ids), prompt_len, margins[i], row=i))
    if not samples:
        raise DataError(
            f"no usable preference pair in {source} ({stats.summary()}); check --max_len and keys"
        )
    return samples, stats


def _margins(dataset: datasets.Dataset, source: str, required: bool = False) -> list[float]:
    """Each row's margin (0 where it has none, unless ``required``)."""
    if MARGIN_COLUMN not in dataset.column_names:
        if required and len(dataset):
            raise DataError(_no_margin(dataset, 0, source))
        return [0.0] * len(dataset)
    out = []
    for i, value in enumerate(dataset[MARGIN_COLUMN]):
        if value is None:
            if required:
                raise DataError(_no_margin(dataset, i, source))
            out.append(0.0)
            continue
        try:
            out.append(float(value))
        except (TypeError, ValueError) as err:
            raise DataError(f"{row_name(dataset, i, source)}: margin {value!r} is not a number") from err
        if not math.isfinite(out[-1]):
            raise DataError(f"{row_name(dataset, i, source)}: margin {value!r} is not finite")
    return out


def _no_margin(dataset: datasets.Dataset, row: int, source: str) -> str:
    return (
        f"{row_name(dataset, row, source)} has no {MARGIN_COLUMN!r} value; --margin_loss needs a number "
        "in every row"
    )


def _render_row(row: dict, where: str, tokenizer, cfg: PairDataConfig) -> tuple[str, str, int, int]:
    """``(chosen_text, rejected_text, chosen_prompt_chars, rejected_prompt_chars)`` of one row."""
    for key in (cfg.prompt_key, cfg.chosen_key, cfg.rejected_key):
        if key is not None and row[key] is None:
            available = [k for k, v in row.items() if v is not None]
            raise DataError(f"{where} has no value for key {key!r}; available keys: {available}")
    try:
        if cfg.prompt_key:
            prompt = render_prompt(
                row[cfg.prompt_key], tokenizer, cfg.input_template, cfg.apply_chat_template
            )
            sides = [
                render_response(row[cfg.prompt_key], row[k], tokenizer, prompt, cfg.apply_chat_template)
                for k in (cfg.chosen_key, cfg.rejected_key)
            ]
            return prompt + sides[0], prompt + sides[1], len(prompt), len(prompt)
        chosen, c_prompt = _render_side(row[cfg.chosen_key], tokenizer, cfg.apply_chat_template)
        rejected, r_prompt = _render_side(row[cfg.rejected_key], tokenizer, cfg.apply_chat_template)
        return chosen, rejected, c_prompt, r_prompt
    except DataError as err:
        raise DataError(f"{where}: {err}") from err


def _render_side(value: Any, tokenizer, apply_chat_template: bool) -> tuple[str, int]:
    """A side without a prompt key: ``(text, prompt characters)``."""
    if not apply_chat_template:
        if not isinstance(value, str):
            raise DataError(
                f"chosen/rejected is a {type(value).__name__}, not a string; "
                "message lists need --apply_chat_template"
            )
        return value + tokenizer.eos_token, 0
    messages = as_messages(value, "assistant")
    text = chat_text(tokenizer, messages).rstrip()
    if len(messages) < 2 or messages[-1]["role"] != "assistant":
        return text, 0  # no separable prompt: the whole conversation is the response
    prompt = chat_text(tokenizer, messages[:-1], add_generation_prompt=True)
    if not text.startswith(prompt):
        raise DataError(
            "the chat template renders the prompt differently with and without the final assistant "
            f"message (not a prefix): {prompt[-60:]!r}"
        )
    return text, len(prompt)


def _encode(tokenizer, texts: list[str], apply_chat_template: bool) -> dict:
    try:
        return tokenize_texts(tokenizer, texts, apply_chat_template, offsets=True)
    except NotImplementedError as err:
        raise DataError("preference pairs need a fast tokenizer (character offsets)") from err


def _prompt_tokens(offsets: list[tuple[int, int]], prompt_chars: int) -> int:
    """Leading tokens that end within the prompt (special tokens like bos have empty spans)."""
    n = 0
    for start, end in offsets:
        if end > prompt_chars or (start == end and start > prompt_chars):
            break
        n += 1
    return n


def identical_pairs(samples: list[PairSample]) -> list[int]:
    """Dataset rows of the pairs whose chosen and rejected sides are the same tokens: such a pair holds
    no preference (DPO's loss sits at log 2 with a zero gradient, a reward model's at its margin)."""
    return [s.row for s in samples if s.chosen_ids == s.rejected_ids]


def pair_halves(samples: list[PairSample]) -> list[SFTSample]:
    """The chosen sequences then the rejected ones, as ``SFTSample``s whose loss mask marks response
    tokens (``t >= prompt_len``), so the SFT collators build the tensors."""
    halves = []
    for side in ("chosen_ids", "rejected_ids"):
        for s in samples:
            ids = getattr(s, side)
            mask = [0] * s.prompt_len + [1] * (len(ids) - s.prompt_len)
            mask[0] = 0  # nothing predicts the first token (tidal.data.collate convention)
            halves.append(SFTSample(ids, mask, row=s.row, images=s.images))
    return halves


def collate_pairs(samples: list[PairSample], pad_id: int, packing: bool = False) -> dict[str, torch.Tensor]:
    """Chosen rows first, then rejected: padded ``[2B, T]`` or one packed row (see module doc)."""
    if not samples:
        raise ValueError("cannot collate an empty micro-batch of pairs")
    halves = pair_halves(samples)
    batch = collate_packed(halves) if packing else collate_padded(halves, pad_id)
    batch["margin"] = torch.tensor([s.margin for s in samples], dtype=torch.float32)
    return batch
