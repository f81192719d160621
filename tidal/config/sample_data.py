"""How dataset rows become samples, per trainer: the data configs of SFT/KD (``SFTDataConfig``), RM/DPO
(``PairDataConfig``), KTO (``UnpairedDataConfig``) and PRM (``PRMDataConfig``).

They live here, not beside the sample builders in ``tidal.data`` (which re-exports them), so that a
trainer's parser builds without importing the datasets library. ``validate`` raises
``DataError`` (``tidal.config.errors``); it runs when samples are built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tidal.config.errors import DataError

DEFAULT_OUTPUT_KEY = "output"


def _flag(default, help: str, **extra):
    """A field whose ``metadata["help"]`` becomes the flag's help text (``tidal.config.args``)."""
    return field(default=default, metadata={"help": help, **extra})


def check_max_len(max_len: int) -> None:
    """Every sample config's length bound: room for at least a prompt token and a response token."""
    if max_len < 2:
        raise DataError(f"--max_len must be at least 2, got {max_len}")


@dataclass
class SFTDataConfig:
    """SFT data: which keys hold the prompt and response, how to render them, what is trained."""

    input_key: str = _flag("input", "dataset key of the prompt (a message list with --multiturn)")
    output_key: str | None = _flag(
        DEFAULT_OUTPUT_KEY, "dataset key of the response; may be unset with --multiturn/--pretrain_mode"
    )
    input_template: str | None = _flag(
        None, "template with '{}' for the prompt, e.g. $'User: {}\\nAssistant: '"
    )
    apply_chat_template: bool = _flag(
        False, "render prompts and responses with the tokenizer's chat template"
    )
    multiturn: bool = _flag(False, "input_key holds a conversation; train on every assistant turn")
    pretrain_mode: bool = _flag(False, "continued pre-training: train on every token")
    max_len: int = _flag(2048, "skip samples longer than this many tokens")

    def validate(self) -> None:
        if self.output_key is None and not (self.multiturn or self.pretrain_mode):
            raise DataError("--output_key is required unless --multiturn or --pretrain_mode is set")
        if self.multiturn and not self.apply_chat_template:
            raise DataError(
                "--multiturn needs --apply_chat_template (turns are found with the chat template)"
            )
        check_max_len(self.max_len)


@dataclass
class PairDataConfig:
    """Preference pairs: which keys hold the prompt, chosen and rejected responses, and how to render."""

    prompt_key: str | None = _flag(None, "dataset key of the prompt (unset: chosen/rejected hold it)")
    chosen_key: str = _flag("chosen", "dataset key of the preferred response or conversation")
    rejected_key: str = _flag("rejected", "dataset key of the dispreferred response or conversation")
    input_template: str | None = _flag(
        None, "template with '{}' for the prompt (needs --prompt_key), e.g. $'User: {}\\nAssistant: '"
    )
    apply_chat_template: bool = _flag(
        False, "render prompts and responses with the tokenizer's chat template"
    )
    max_len: int = _flag(512, "skip pairs whose chosen or rejected sequence is longer than this")

    def validate(self) -> None:
        if self.input_template and not self.prompt_key:
            raise DataError("--input_template formats the prompt, so it needs --prompt_key")
        check_max_len(self.max_len)


@dataclass
class UnpairedDataConfig:
    """Unpaired (KTO) data: keys of the prompt, the response and its desirable/undesirable label."""

    input_key: str = _flag("input", "dataset key of the prompt")
    output_key: str = _flag("output", "dataset key of the response")
    label_key: str = _flag("label", "dataset key of the label: true (desirable) or false (undesirable)")
    input_template: str | None = _flag(
        None, "template with '{}' for the prompt, e.g. $'User: {}\\nAssistant: '"
    )
    apply_chat_template: bool = _flag(
        False, "render prompts and responses with the tokenizer's chat template"
    )
    max_len: int = _flag(2048, "skip samples whose prompt + response is longer than this many tokens")

    def validate(self) -> None:
        check_max_len(self.max_len)


@dataclass
class PRMDataConfig:
    """PRM data: the text with step markers, the per-step labels and the reward tokens."""

    input_key: str = _flag("input", "dataset key of the text with a step marker after every step")
    label_key: str = _flag("label", "dataset key of the per-step labels (reward-token strings or 0-1 floats)")
    placeholder_token: str = _flag("ки", "the step-marker token; the reward is predicted at it")
    reward_tokens: list[str] | None = _flag(
        None,
        "tokens the step reward is read from, good first (e.g. + -); unset: the whole vocabulary",
        nargs="+",
    )
    input_template: str | None = _flag(None, "template with '{}' for the input text")
    apply_chat_template: bool = _flag(False, "render the input as a user message with the chat template")
    max_len: int = _flag(2048, "skip samples longer than this many tokens")

    def validate(self) -> None:
        check_max_len(self.max_len)
        if self.reward_tokens is not None and len(set(self.reward_tokens)) != len(self.reward_tokens):
            raise DataError(f"--reward_tokens must be distinct, got {self.reward_tokens}")
