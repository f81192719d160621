"""RL prompt samples (``--prompt_data``, ``--input_key``, ``--label_key``) for PPO-family training.

Each row becomes a ``PromptSample``: the rendered prompt text (see ``tidal.data.templates``), the
optional label handed to ``reward_func(queries, prompts, labels)``, and the row's other columns in
``extra`` (e.g. a data-source tag for per-source metrics). Prompts longer than ``max_prompt_len``
tokens (counted with the shared tokenization rule of ``templates.tokenize_texts``) are skipped and
counted, never truncated: a truncated question is a different question.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tidal.data.errors import DataError
from tidal.data.rows import check_text_columns, require_keys, row_name
from tidal.data.sft import SkipStats
from tidal.data.templates import render_prompt, tokenize_texts

if TYPE_CHECKING:  # annotations only: importing datasets (with pandas, pyarrow) costs a second per process
    import datasets


@dataclass
class PromptSample:
    prompt: str
    label: Any | None = None
    extra: dict = field(default_factory=dict)
    images: tuple = ()  # the row's ImageRefs (RL with images: tidal.experience.images)


def build_prompt_samples(
    dataset: datasets.Dataset,
    tokenizer,
    input_key: str,
    label_key: str | None = None,
    input_template: str | None = None,
    apply_chat_template: bool = False,
    max_prompt_len: int | None = None,
    source: str = "dataset",
) -> tuple[list[PromptSample], SkipStats]:
    """Render every row's prompt; skip (and count) prompts over ``max_prompt_len`` tokens."""
    require_keys(dataset, [input_key, label_key], source)
    # The whole column first: an empty prompt fails here, before any model loads, not at a rollout.
    check_text_columns(dataset, [input_key], source, apply_chat_template, non_empty=[input_key])
    samples, stats = [], SkipStats()
    for i, row in enumerate(dataset):
        value = row[input_key]
        if value is None:
            available = [k for k, v in row.items() if v is not None]
            raise DataError(
                f"{row_name(dataset, i, source)} has no value for key {input_key!r}; available keys: {available}"
            )
        try:
            prompt = render_prompt(value, tokenizer, input_template, apply_chat_template)
        except DataError as err:
            raise DataError(f"{row_name(dataset, i, source)}: {err}") from err
        extra = {k: v for k, v in row.items() if k not in (input_key, label_key)}
        samples.append(PromptSample(prompt, row[label_key] if label_key else None, extra))
    if max_prompt_len is not None:
        samples = _drop_long(samples, tokenizer, apply_chat_template, max_prompt_len, stats)
    if not samples:
        raise DataError(f"no usable prompt in {source} ({stats.summary()}); check --prompt_max_len")
    return samples, stats


def _drop_long(samples, tokenizer, apply_chat_template: bool, max_len: int, stats: SkipStats) -> list:
    kept = []
    for start in range(0, len(samples), 1024):
        chunk = samples[start : start + 1024]
        ids = tokenize_texts(tokenizer, [s.prompt for s in chunk], apply_chat_template)["input_ids"]
        for offset, (sample, tokens) in enumerate(zip(chunk, ids, strict=True)):
            if len(tokens) > max_len:
                stats.add("too_long", start + offset)
            else:
                kept.append(sample)
    return kept
