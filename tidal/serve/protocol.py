"""The OpenAI wire format of ``tidal serve``, one import for its three parts:

- ``tidal.serve.schema``: the shared types (``ServeRequest``, ``RequestError``, ``ModelLimits``) and the
  decoding of a request body (``decode_body``: every malformed body is a 400, never a 500);
- ``tidal.serve.validation``: a body → a ``ServeRequest`` (every field's type and range checked before
  the engine sees it: ``parse_chat``, ``parse_completion``);
- ``tidal.serve.responses``: engine outputs → response and stream-chunk bodies.

Tools follow OpenAI: chat ``tools`` reach the chat template (``apply_chat_template(..., tools=)``), and
unless ``tool_choice`` is ``"none"`` each answer is parsed with the tool parser matching the template
(``tidal.data.tool_parsers.detect_tool_parser``, as the tool agent executor picks it): calls become
``message.tool_calls`` (arguments as a JSON string) with ``finish_reason: "tool_calls"`` and the text
outside them the ``content`` (null when empty); an answer whose calls do not parse stays plain content.
Parsing only rewrites the answer: the sampled ids and log-probs (what an RL recorder keeps) are untouched.
"""

from tidal.serve.responses import (
    LOGPROB_FLOOR,
    Alternatives,
    assistant_answer,
    chat_logprobs,
    chunk_body,
    chunk_choice,
    completion_logprobs,
    finite_logprob,
    response_body,
    streamable_text,
    token_bytes,
    token_text,
    usage,
)
from tidal.serve.schema import CHAT, COMPLETIONS, ModelLimits, RequestError, ServeRequest, decode_body
from tidal.serve.validation import (
    TOOL_CHOICES,
    chat_prompt_ids,
    check_model,
    completion_prompt_ids,
    message_text,
    parse_chat,
    parse_completion,
)

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "LOGPROB_FLOOR",
    "TOOL_CHOICES",
    "Alternatives",
    "ModelLimits",
    "RequestError",
    "ServeRequest",
    "assistant_answer",
    "chat_logprobs",
    "chat_prompt_ids",
    "check_model",
    "chunk_body",
    "chunk_choice",
    "completion_logprobs",
    "completion_prompt_ids",
    "decode_body",
    "finite_logprob",
    "message_text",
    "parse_chat",
    "parse_completion",
    "response_body",
    "streamable_text",
    "token_bytes",
    "token_text",
    "usage",
]
