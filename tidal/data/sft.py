"""SFT samples: token ids plus a loss mask saying which tokens are trained.

Convention (shared with ``tidal.data.collate``): ``loss_mask[t] == 1`` means token ``t`` is a
*target*, predicted from the logits at position ``t - 1``. The first token of every sample therefore
always has ``loss_mask == 0``.

Modes (OpenRLHF's ``train_sft`` flags):

- default: loss on the response tokens only (``response + eos``, or the assistant turn as the chat
  template renders it, including its end-of-turn token);
- ``pretrain_mode``: every token is trained (text = prompt + response, or just ``input_key``);
- ``multiturn``: ``input_key`` holds a message list; every assistant turn is trained. Turn spans come
  from rendering incrementally (prefix up to each assistant message with ``add_generation_prompt``
  vs. including it), which works for any chat template that renders prefixes as prefixes.

Text is rendered per row, the full texts are tokenized in batches once, and tokens are marked as
trained when their character offsets overlap a trained character span. A token that straddles the
prompt/response boundary (BPE merging the template's trailing space into the first response word)
is trained, since it carries response text. Samples longer than ``max_len`` or with no trained token
are skipped and counted in ``SkipStats`` (the caller logs them), never truncated.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from tidal.config.sample_data import DEFAULT_OUTPUT_KEY, SFTDataConfig
from tidal.data.errors import DataError
from tidal.data.rows import check_text_columns, require_keys, row_name
from tidal.data.templates import as_messages, chat_text, render_prompt, render_response, tokenize_texts

if TYPE_CHECKING:  # annotations only: importing datasets (with pandas, pyarrow) costs a second per process
    import datasets

Span = tuple[int, int]


@dataclass
class SFTSample:
    input_ids: list[int]
    loss_mask: list[int]  # same length; 1 where the token is a training target
    row: int = -1  # index of the dataset row it came from, for debugging
    images: Any = None  # its images (tidal.data.vision.SampleImages), for vision-language models

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class SkipStats:
    """Rows dropped while building samples, by reason, with the first few row indices."""

    too_long: int = 0
    no_target: int = 0
    rows: list[int] = field(default_factory=list)
    max_rows: int = 10

    @property
    def count(self) -> int:
        return self.too_long + self.no_target

    def add(self, reason: str, row: int) -> None:
        setattr(self, reason, getattr(self, reason) + 1)
        if len(self.rows) < self.max_rows:
            self.rows.append(row)

    def summary(self) -> str:
        return (
            f"skipped {self.count} sample(s): {self.too_long} longer than max_len, "
            f"{self.no_target} without a trained token; first rows: {self.rows}"
        )


def build_sft_samples(
    dataset: datasets.Dataset,
    tokenizer,
    cfg: SFTDataConfig,
    source: str = "dataset",
    batch_size: int = 1024,
) -> tuple[list[SFTSample], SkipStats]:
    """Render, tokenize and mask every row; return the kept samples and what was skipped."""
    cfg.validate()
    cfg = replace(cfg, output_key=_effective_output_key(cfg, dataset.column_names))
    require_keys(dataset, [cfg.input_key, cfg.output_key], source)
    check_text_columns(
        dataset, [cfg.input_key, cfg.output_key], source, cfg.apply_chat_template or cfg.multiturn
    )
    inputs = list(dataset[cfg.input_key])
    outputs = list(dataset[cfg.output_key]) if cfg.output_key else [None] * len(inputs)
    samples: list[SFTSample] = []
    stats = SkipStats()
    for start in range(0, len(inputs), batch_size):
        rows = range(start, min(start + batch_size, len(inputs)))
        rendered = [render_sft_row(inputs[i], outputs[i], tokenizer, cfg, i, dataset, source) for i in rows]
        encoded = _encode_with_offsets(tokenizer, [text for text, _ in rendered], cfg.apply_chat_template)
        for i, (_, spans), ids, offsets in zip(
            rows, rendered, encoded["input_ids"], encoded["offset_mapping"], strict=True
        ):
            mask = mask_from_spans(offsets, spans)
            if len(ids) > cfg.max_len:
                stats.add("too_long", i)
            elif not any(mask):
                stats.add("no_target", i)
            else:
                samples.append(SFTSample(list(ids), mask, row=i))
    if not samples:
        raise DataError(f"no usable SFT sample in {source} ({stats.summary()}); check --max_len and the keys")
    return samples, stats


def _effective_output_key(cfg: SFTDataConfig, columns: list[str]) -> str | None:
    # The flag cannot be set to None from the command line, so with --multiturn/--pretrain_mode the
    # *default* "output" simply means "no response column" when the dataset has none; an explicitly
    # named key that is missing is still an error.
    if (
        (cfg.multiturn or cfg.pretrain_mode)
        and cfg.output_key == DEFAULT_OUTPUT_KEY
        and cfg.output_key not in columns
    ):
        return None
    return cfg.output_key


def render_sft_row(
    value: Any, output: Any, tokenizer, cfg: SFTDataConfig, row: int, dataset=None, source: str = "dataset"
) -> tuple[str, list[Span]]:
    """Render one row as ``(text, trained character spans)``."""
    for key, item in ((cfg.input_key, value), (cfg.output_key, output)):
        if key is not None and item is None:
            available = [k for k, v in dataset[row].items() if v is not None] if dataset is not None else "?"
            raise DataError(
                f"{row_name(dataset, row, source)} has no value for key {key!r}; available keys: {available}"
            )
    try:
        if cfg.multiturn:
            text, spans = _render_multiturn(value, output, tokenizer)
        else:
            text, spans = _render_single_turn(value, output, tokenizer, cfg)
    except DataError as err:
        raise DataError(f"{row_name(dataset, row, source)}: {err}") from err
    return text, [(0, len(text))] if cfg.pretrain_mode else spans


def _render_single_turn(value: Any, output: Any, tokenizer, cfg: SFTDataConfig) -> tuple[str, list[Span]]:
    if output is None:  # pretrain_mode without an output key: the input is the whole document
        if cfg.apply_chat_template:
            return chat_text(tokenizer, as_messages(value, "user")).rstrip(), []
        return render_prompt(value, tokenizer, cfg.input_template, False) + tokenizer.eos_token, []
    prompt = render_prompt(value, tokenizer, cfg.input_template, cfg.apply_chat_template)
    response = render_response(value, output, tokenizer, prompt, cfg.apply_chat_template)
    return prompt + response, [(len(prompt), len(prompt) + len(response))]


def _render_multiturn(value: Any, output: Any, tokenizer) -> tuple[str, list[Span]]:
    messages = as_messages(value, "user")
    if output is not None:
        messages += as_messages(output, "assistant")
    text = chat_text(tokenizer, messages).rstrip()
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = chat_text(tokenizer, messages[:i], add_generation_prompt=True)
        through = chat_text(tokenizer, messages[: i + 1]).rstrip()
        if not (text.startswith(before) and text.startswith(through) and through.startswith(before)):
            raise DataError(
                f"the chat template does not render conversation prefixes as prefixes (turn {i}); "
                "multiturn loss masks cannot be derived from it"
            )
        spans.append((len(before), len(through)))
    return text, spans


def _encode_with_offsets(tokenizer, texts: list[str], apply_chat_template: bool) -> dict:
    try:
        return tokenize_texts(tokenizer, texts, apply_chat_template, offsets=True)
    except NotImplementedError as err:
        raise DataError("SFT loss masks need a fast tokenizer (character offsets)") from err


def mask_from_spans(offsets: list[tuple[int, int]], spans: list[Span]) -> list[int]:
    """1 for tokens whose characters overlap a trained span; 0 always for the first token."""
    mask = [int(any(end > a and start < b for a, b in spans)) for start, end in offsets]
    if mask:
        mask[0] = 0  # nothing predicts the first token (see the module's convention)
    return mask
