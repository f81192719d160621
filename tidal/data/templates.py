"""Render dataset rows into prompt / response text and tokenize rendered text consistently.

Three ways to render a prompt, as OpenRLHF's ``--input_template`` / ``--apply_chat_template``:

- ``apply_chat_template``: the value (a string becomes one user message, or a list of
  ``{"role", "content"}`` messages) is rendered by the tokenizer's chat template with
  ``add_generation_prompt=True``;
- ``input_template`` (contains ``{}``): the string is formatted into it;
- neither: the string as is. A template that is only a pair of quotes (``""``, ``''``) is no template:
  OpenRLHF's scripts pass ``--input_template ""`` inside a command string that the shell word-splits,
  so the two quote characters arrive literally (OpenRLHF would make every prompt ``""``).

A response is ``response + eos_token`` without a chat template (as OpenRLHF), and with one it is
the assistant turn exactly as the template renders it: the full conversation minus the prompt
rendering. Trailing whitespace after the end of the last turn (ChatML's ``"\\n"`` after
``<|im_end|>``) is dropped: there is nothing to learn there and generation stops at eos.

Tokenization rule shared by SFT, prompts and rollout: chat-rendered text already holds the special
tokens the template wants (e.g. bos), so it is tokenized with ``add_special_tokens=False``; plain
text is tokenized with ``add_special_tokens=True`` so a Llama-style tokenizer adds bos once.
"""

from __future__ import annotations

from typing import Any

from tidal.data.errors import DataError

Messages = list[dict[str, Any]]
QUOTED_EMPTY = ('""', "''")  # an empty template as a word-split shell command string delivers it


def render_prompt(value: Any, tokenizer, input_template: str | None, apply_chat_template: bool) -> str:
    """Render a prompt (string or message list) as the text the model is conditioned on."""
    if apply_chat_template:
        return chat_text(tokenizer, as_messages(value, "user"), add_generation_prompt=True)
    if not isinstance(value, str):
        raise DataError(
            f"prompt is a {type(value).__name__}, not a string; message lists need --apply_chat_template"
        )
    if input_template and input_template not in QUOTED_EMPTY:
        check_input_template(input_template)
        return input_template.format(value)
    return value


def render_response(
    prompt_value: Any, response_value: Any, tokenizer, prompt_text: str, apply_chat_template: bool
) -> str:
    """Render the response that follows ``prompt_text`` (the output of ``render_prompt``)."""
    if not apply_chat_template:
        if not isinstance(response_value, str):
            raise DataError(
                f"response is a {type(response_value).__name__}, not a string; "
                "message lists need --apply_chat_template"
            )
        return response_value + tokenizer.eos_token
    messages = as_messages(prompt_value, "user") + as_messages(response_value, "assistant")
    full = chat_text(tokenizer, messages).rstrip()
    if not full.startswith(prompt_text):
        raise DataError(
            "the chat template renders the prompt differently with and without the response "
            f"(prompt rendering is not a prefix of the conversation): {prompt_text[-60:]!r}"
        )
    return full[len(prompt_text) :]


def as_messages(value: Any, role: str) -> Messages:
    """A string becomes one message of ``role``; a message list is checked and returned as is."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        return list(value)
    raise DataError(f"expected a string or a list of {{'role', 'content'}} messages, got {str(value)[:80]!r}")


def chat_text(tokenizer, messages: Messages, add_generation_prompt: bool = False) -> str:
    """Render messages with the tokenizer's chat template, as text."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("--apply_chat_template was given but the tokenizer has no chat template")
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def check_input_template(input_template: str) -> None:
    if "{}" not in input_template:
        raise DataError(f"--input_template must contain '{{}}' where the input goes, got {input_template!r}")


def tokenize_texts(tokenizer, texts: list[str], apply_chat_template: bool, offsets: bool = False) -> dict:
    """Tokenize rendered texts in one batched call, following the module's special-token rule."""
    return tokenizer(
        texts,
        add_special_tokens=not apply_chat_template,
        return_offsets_mapping=offsets,
        return_attention_mask=False,
        verbose=False,
    )
