"""What every part of ``tidal serve`` shares: the validated request (``ServeRequest``), the error a
refused request becomes (``RequestError``), the served model's limits (``ModelLimits``), and the
decoding of a request body into a JSON object (``decode_body``).

``decode_body`` turns every way a body can be malformed into a 400 naming the problem, never a 500:
invalid or non-UTF-8 JSON, ``NaN``/``Infinity`` (not JSON), an integer of more than Python's
4300 digits, nesting deeper than ``MAX_JSON_DEPTH`` and strings holding a lone UTF-16 surrogate
(``"\\ud800"`` is valid JSON but no UTF-8 text: tokenizers and chat templates fail on it).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from tidal.rollout import SamplingParams

CHAT, COMPLETIONS = "chat.completions", "completions"
MAX_JSON_DEPTH = 64  # an OpenAI request nests about 6 deep (tools' JSON schemas a few more)


class RequestError(Exception):
    """A request the server refuses; becomes ``{"error": {"message", "type", "code", "param"}}``."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        code: str | None = None,
        param: str | None = None,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message, self.status, self.code, self.param, self.type = message, status, code, param, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


@dataclass
class ServeRequest:
    """A validated request: what the engine runs and how the answer is written."""

    endpoint: str  # CHAT or COMPLETIONS
    prompts: list[list[int]]  # one engine request per prompt (a completions batch may hold several)
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False  # streaming: a last chunk with the usage
    logprobs: bool = False
    episode_id: str | None = None
    tool_parser: str | None = None  # chat: parse answers into tool_calls with this parser (None: do not)
    multi_modal: list | None = None  # each prompt's images (a MultiModalInput or None); None: text only
    request_id: str = ""  # OpenAI's prefixes: chatcmpl-... for chat, cmpl-... for completions
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.request_id:
            prefix = "chatcmpl" if self.endpoint == CHAT else "cmpl"
            self.request_id = f"{prefix}-{uuid.uuid4().hex}"

    @property
    def n(self) -> int:
        return self.params.n


@dataclass(frozen=True)
class ModelLimits:
    """What the served model allows: its id, context length, default completion length, vocabulary
    size (``top_k`` at or above it means no truncation) and the most samples (prompts × ``n``) one
    request may ask for."""

    name: str
    max_model_len: int
    default_max_tokens: int | None = None
    vocab_size: int | None = None
    max_samples: int = 256


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def decode_body(raw: bytes) -> dict:
    """A request body → its JSON object, or a ``RequestError`` (400) saying what is wrong with it."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError as err:  # json's C parser recurses once per level: [[[[...]]]]
        raise RequestError(
            "the request body is not valid JSON: nested too deeply", code="invalid_json"
        ) from err
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, too many digits, NaN/Infinity
        raise RequestError(f"the request body is not valid JSON ({err})", code="invalid_json") from err
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _check_tree(body)
    return body


def _check_tree(body: dict) -> None:
    """Depth and string checks over the whole body, iteratively (no recursion to exhaust)."""
    stack: list[tuple[object, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise RequestError(
                f"the request body nests more than {MAX_JSON_DEPTH} levels deep", code="invalid_json"
            )
        if isinstance(value, str):
            _check_text(value)
        elif isinstance(value, dict):
            stack.extend((k, depth) for k in value)
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


def _check_text(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RequestError(
            f"the request body holds a string that is not valid Unicode text ({err.reason}: "
            f"{text[err.start : err.end]!r} at character {err.start})",
            code="invalid_json",
        ) from None
