"""Unpaired preference samples for KTO: one prompt, one response and a desirable/undesirable label.

Rows hold ``--input_key`` (prompt: string, or message list with ``--apply_chat_template``),
``--output_key`` (response) and ``--label_key`` (``true``/``false``, or ``1``/``0``). The prompt is
rendered as in SFT (``render_prompt``) and the response as what follows it (``render_response``:
``response + eos``, or the assistant turn of the chat template).

Prompt and response are tokenized *separately* and concatenated (as TRL's KTO does): KTO's KL
reference point pairs each prompt with another row's response, and separate token ids let any
prompt be joined to any response exactly as a generated response follows its prompt tokens.
Samples longer than ``max_len`` tokens are skipped and counted in ``SkipStats``, never truncated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tidal.config.sample_data import UnpairedDataConfig
from tidal.data.errors import DataError
from tidal.data.rows import check_text_columns, require_keys, row_name
from tidal.data.sft import SFTSample, SkipStats
from tidal.data.templates import render_prompt, render_response, tokenize_texts

if TYPE_CHECKING:  # annotations only: importing datasets (with pandas, pyarrow) costs a second per process
    import datasets


@dataclass
class UnpairedSample:
    prompt_ids: list[int]
    response_ids: list[int]
    desirable: bool
    row: int = -1  # index of the dataset row it came from, for error messages

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def with_response(self, other: UnpairedSample) -> UnpairedSample:
        """This prompt with ``other``'s response (a mismatched pair for KTO's KL estimate)."""
        return UnpairedSample(self.prompt_ids, other.response_ids, self.desirable, self.row)

    def as_sft(self) -> SFTSample:
        """The full sequence with the response tokens marked as targets (``tidal.data.collate``)."""
        mask = [0] * len(self.prompt_ids) + [1] * len(self.response_ids)
        mask[0] = 0  # nothing predicts the first token
        return SFTSample(self.prompt_ids + self.response_ids, mask, row=self.row)


def parse_label(value: Any, where: str, key: str) -> bool:
    """``true``/``false`` (or ``1``/``0``) → bool; anything else is an error naming the row."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    raise DataError(f"{where}: label {key!r} must be true/false (or 1/0), got {value!r}")


def build_unpaired_samples(
    dataset: datasets.Dataset,
    tokenizer,
    cfg: UnpairedDataConfig,
    source: str = "dataset",
    batch_size: int = 1024,
) -> tuple[list[UnpairedSample], SkipStats]:
    """Render, tokenize and label every row; return the kept samples and what was skipped."""
    cfg.validate()
    require_keys(dataset, [cfg.input_key, cfg.output_key, cfg.label_key], source)
    check_text_columns(dataset, [cfg.input_key, cfg.output_key], source, cfg.apply_chat_template)
    samples: list[UnpairedSample] = []
    stats = SkipStats()
    for start in range(0, len(dataset), batch_size):
        rows = range(start, min(start + batch_size, len(dataset)))
        rendered = [_render_row(dataset[i], row_name(dataset, i, source), tokenizer, cfg) for i in rows]
        prompts = tokenize_texts(tokenizer, [p for p, _, _ in rendered], cfg.apply_chat_template)
        # A response continues the prompt's tokens, so it never gets special tokens of its own.
        responses = tokenizer(
            [r for _, r, _ in rendered], add_special_tokens=False, return_attention_mask=False, verbose=False
        )
        for k, i in enumerate(rows):
            p_ids, r_ids = list(prompts["input_ids"][k]), list(responses["input_ids"][k])
            if len(p_ids) + len(r_ids) > cfg.max_len:
                stats.add("too_long", i)
            elif not r_ids or not p_ids:
                stats.add("no_target", i)
            else:
                samples.append(UnpairedSample(p_ids, r_ids, rendered[k][2], row=i))
    if not samples:
        raise DataError(f"no usable sample in {source} ({stats.summary()}); check --max_len and the keys")
    return samples, stats


def _render_row(row: dict, where: str, tokenizer, cfg: UnpairedDataConfig) -> tuple[str, str, bool]:
    """``(prompt_text, response_text, desirable)`` of one row."""
    for key in (cfg.input_key, cfg.output_key, cfg.label_key):
        if row[key] is None:
            available = [k for k, v in row.items() if v is not None]
            raise DataError(f"{where} has no value for key {key!r}; available keys: {available}")
    desirable = parse_label(row[cfg.label_key], where, cfg.label_key)
    try:
        prompt = render_prompt(row[cfg.input_key], tokenizer, cfg.input_template, cfg.apply_chat_template)
        response = render_response(
            row[cfg.input_key], row[cfg.output_key], tokenizer, prompt, cfg.apply_chat_template
        )
    except DataError as err:
        raise DataError(f"{where}: {err}") from err
    return prompt, response, desirable
