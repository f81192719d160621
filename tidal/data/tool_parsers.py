"""Tool-call parsers: a model's text → OpenAI-style ``tool_calls``, one parser per chat-template format.

    parsed = parse_tool_calls(text, "hermes")
    parsed.content      # the text outside the calls, stripped
    parsed.tool_calls   # [{"id": "call_0", "type": "function",
                        #   "function": {"name": "multiply", "arguments": '{"a": 12, "b": 34}'}}]

Formats (``TOOL_PARSERS``, filled by ``@register(TOOL_PARSERS, name)`` beside each function):

- ``hermes`` (Hermes, Qwen2.5/Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number of them, anywhere in the message. A last ``<tool_call>`` left unclosed (generation
  stopped at ``</tool_call>`` used as a stop string) is read up to the end of the text.
- ``llama3_json`` (Llama 3.1–3.3 JSON tool calling): the whole message is ``{"name": ...,
  "parameters": {...}}``, optionally after ``<|python_tag|>``; several calls are separated by ``;``.
  A message is a call attempt when it starts with ``<|python_tag|>`` or with ``{`` and names a
  ``"name"`` key; anything else is a plain answer.

A message with no call attempt parses to ``tool_calls == []``. A call attempt that is not valid JSON,
is not an object, lacks a string ``name`` or has non-object arguments raises ``ToolParseError`` whose
message says which call and why (the agent executor ends that episode with reward 0).

``detect_tool_parser(chat_template)`` names the parser whose format the template renders, or None.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tidal.algorithms.registry import register


class ToolParseError(ValueError):
    """The model's message tries to call a tool but the call is malformed; the message says why."""


@dataclass(frozen=True)
class ParsedMessage:
    """An assistant message split into its text and its OpenAI-style tool calls."""

    content: str
    tool_calls: list[dict] = field(default_factory=list)

    @property
    def calls(self) -> list[tuple[str, dict]]:
        """``(name, arguments)`` of each call, arguments decoded back into a dict."""
        return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in self.tool_calls]


ToolParser = Callable[[str], ParsedMessage]
TOOL_PARSERS: dict[str, ToolParser] = {}


def parse_tool_calls(text: str, parser: str) -> ParsedMessage:
    """Parse ``text`` with the named parser (``TOOL_PARSERS``); raises ``ToolParseError`` on bad calls."""
    return get_tool_parser(parser)(text)


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; expected one of {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]


def tool_call(index: int, name: str, arguments: dict) -> dict:
    """One OpenAI ``tool_calls`` entry (arguments as a JSON string, as the OpenAI API sends them)."""
    return {
        "id": f"call_{index}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _call_from_json(raw: str, index: int, arguments_keys: tuple[str, ...]) -> dict:
    """Decode one call's JSON text into a ``tool_call`` entry; ``ToolParseError`` says what is wrong."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ToolParseError(
            f"tool call {index} is not valid JSON ({err.msg} at char {err.pos}): {_clip(raw)}"
        ) from None
    return _call_from_object(obj, index, arguments_keys, raw)


def _call_from_object(obj: Any, index: int, arguments_keys: tuple[str, ...], raw: str) -> dict:
    if not isinstance(obj, dict):
        raise ToolParseError(f"tool call {index} is a JSON {type(obj).__name__}, not an object: {_clip(raw)}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ToolParseError(f"tool call {index} has no string 'name': {_clip(raw)}")
    key = next((k for k in arguments_keys if k in obj), None)
    arguments = {} if key is None else obj[key]
    if isinstance(arguments, str):  # some models emit the arguments as a JSON string, as OpenAI sends them
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ToolParseError(
                f"tool call {index} ({name}): '{key}' is a string but not JSON: {_clip(raw)}"
            ) from None
    if not isinstance(arguments, dict):
        raise ToolParseError(
            f"tool call {index} ({name}): '{key}' must be an object, got {type(arguments).__name__}"
        )
    return tool_call(index, name, arguments)


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


@register(TOOL_PARSERS, "hermes")
def parse_hermes(text: str) -> ParsedMessage:
    """``<tool_call>{json}</tool_call>`` blocks anywhere in the message (Hermes, Qwen2.5, Qwen3)."""
    matches = list(_HERMES.finditer(text))
    calls = [
        _call_from_json(m.group(1).strip(), i, ("arguments", "parameters")) for i, m in enumerate(matches)
    ]
    content = _HERMES.sub("", text).strip() if matches else text.strip()
    return ParsedMessage(content, calls)


PYTHON_TAG = "<|python_tag|>"


@register(TOOL_PARSERS, "llama3_json")
def parse_llama3_json(text: str) -> ParsedMessage:
    """The whole message as ``{"name", "parameters"}`` objects separated by ``;`` (Llama 3.x JSON)."""
    body = text.strip()
    tagged = body.startswith(PYTHON_TAG)
    body = body[len(PYTHON_TAG) :].strip() if tagged else body
    if not tagged and not (body.startswith("{") and '"name"' in body):
        return ParsedMessage(text.strip())
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as err:
            raise ToolParseError(
                f"tool call {len(calls)} is not valid JSON ({err.msg} at char {err.pos}): {_clip(body[pos:])}"
            ) from None
        calls.append(_call_from_object(obj, len(calls), ("parameters", "arguments"), body[pos:end]))
        pos = _skip_separator(body, end, len(calls))
    if not calls:
        raise ToolParseError(f"{PYTHON_TAG} is followed by no tool call")
    return ParsedMessage("", calls)


def _skip_separator(body: str, pos: int, count: int) -> int:
    """Position of the next call after ``;`` (and whitespace); the end when only whitespace is left."""
    rest = body[pos:].lstrip()
    if not rest:
        return len(body)
    if not rest.startswith(";"):
        raise ToolParseError(
            f"text after tool call {count - 1} (expected ';' and another call): {_clip(rest)}"
        )
    return len(body) - len(rest[1:].lstrip())


def detect_tool_parser(chat_template: str | dict | None) -> str | None:
    """The parser for the format a chat template renders tool calls in, or None when it shows none.

    A dict (tokenizers that keep several named templates) is searched as a whole."""
    if isinstance(chat_template, dict):
        chat_template = "\n".join(str(t) for t in chat_template.values())
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if PYTHON_TAG in chat_template or (
        '"parameters"' in chat_template and "<|start_header_id|>" in chat_template
    ):
        return "llama3_json"
    return None


def _clip(text: str, limit: int = 120) -> str:
    text = text.strip()
    return repr(text if len(text) <= limit else text[:limit] + "...")
