"""Response building: engine outputs → OpenAI response and stream-chunk bodies (pure functions).

Log-probs follow OpenAI: chat ``logprobs: true`` with ``top_logprobs: k`` (0..20) gives each content token
its k most likely alternatives (token, logprob, bytes); completions ``logprobs: k`` (0..5) gives each
token a ``{token: logprob}`` dict of the k most likely and the sampled one. Every value is of the
distribution the token was sampled from, ``log_softmax(logits / temperature)`` before top-k / top-p
truncation (raw logits when greedy; see ``SamplingParams``), where vLLM by default reports the raw
logits' log-softmax whatever the temperature. A value that is not finite (a token the model gives
probability 0, or a broken model's NaN) is written as OpenAI's floor, ``-9999.0``: JSON has no NaN
or infinity, and a client's parser would choke on them.

A token's ``bytes`` are its own bytes, also for a token that holds part of a UTF-8 character (its
text is then U+FFFD): byte-level BPE tokens are mapped back through their byte alphabet, SentencePiece
byte-fallback tokens (``<0xE4>``) read as the byte they name.
"""

from __future__ import annotations

import functools
import math
import re
import uuid
from typing import Any

from tidal.data.tool_parsers import ToolParseError, parse_tool_calls
from tidal.rollout import RequestOutput
from tidal.serve.schema import CHAT, ServeRequest

LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a log-prob of -inf
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def finite_logprob(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


Alternatives = list[tuple[int, float]]  # one token's (token id, log-prob) alternatives, most likely first


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes a token stands for (see the module doc); the text's UTF-8 for other tokenizers."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    alphabet = _byte_alphabet(tokenizer)
    if isinstance(piece, str):
        if alphabet is not None and all(ch in alphabet for ch in piece):
            return bytes(alphabet[ch] for ch in piece)
        match = _BYTE_TOKEN.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
    return token_text(tokenizer, token_id).encode()


def _byte_alphabet(tokenizer) -> dict[str, int] | None:
    """Character → byte of a byte-level BPE tokenizer's alphabet (GPT-2, Llama 3, Qwen); None for other
    tokenizers."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or "ByteLevel" not in str(backend.decoder):
        return None
    return _byte_level_alphabet()


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {ch: b for b, ch in bytes_to_unicode().items()}


def _chat_token(tokenizer, token_id: int, logprob: float) -> dict:
    text = token_text(tokenizer, token_id)
    return {
        "token": text,
        "logprob": finite_logprob(logprob),
        "bytes": list(token_bytes(tokenizer, token_id)),
    }


def chat_logprobs(
    tokenizer, token_ids: list[int], logprobs: list[float], tops: list[Alternatives] | None = None
) -> dict:
    """``choice.logprobs`` of a chat answer; ``tops``: each token's alternatives (None: ``top_logprobs`` 0)."""
    content = []
    for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
        entry = _chat_token(tokenizer, token_id, logprob)
        entry["top_logprobs"] = [] if tops is None else [_chat_token(tokenizer, t, v) for t, v in tops[i]]
        content.append(entry)
    return {"content": content, "refusal": None}


def _completion_top(tokenizer, token_id: int, logprob: float, top: Alternatives) -> dict[str, float]:
    """OpenAI's legacy ``{token: logprob}``: the k most likely tokens, and the sampled one (so up to k + 1
    entries); tokens that decode to the same text share one key, the most likely one's value."""
    alternatives: dict[str, float] = {}
    for t, value in [*top, (token_id, logprob)]:
        alternatives.setdefault(token_text(tokenizer, t), finite_logprob(value))
    return alternatives


def completion_logprobs(
    tokenizer,
    token_ids: list[int],
    logprobs: list[float],
    offset: int = 0,
    tops: list[Alternatives] | None = None,
) -> dict:
    """``choice.logprobs`` of a completion; ``tops``: each token's alternatives (None: ``logprobs`` 0)."""
    tokens = [token_text(tokenizer, t) for t in token_ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    top_logprobs = None
    if tops is not None:
        top_logprobs = [
            _completion_top(tokenizer, t, v, top) for t, v, top in zip(token_ids, logprobs, tops, strict=True)
        ]
    return {"tokens": tokens, "token_logprobs": [finite_logprob(v) for v in logprobs], "top_logprobs": top_logprobs,
            "text_offset": offsets}  # fmt: skip


def assistant_answer(
    text: str, finish_reason: str | None, tool_parser: str | None
) -> tuple[dict, str | None]:
    """A chat answer's message fields (``content``, and ``tool_calls`` when it calls tools) and its
    finish reason: ``"tool_calls"`` when the text parses as calls; a malformed call stays plain text."""
    if tool_parser is None:
        return {"content": text}, finish_reason
    try:
        parsed = parse_tool_calls(text, tool_parser)
    except ToolParseError:
        return {"content": text}, finish_reason
    if not parsed.tool_calls:
        return {"content": text}, finish_reason
    # The parser numbers calls within one message; a conversation needs ids that differ across turns.
    calls = [{**call, "id": f"call_{uuid.uuid4().hex[:24]}"} for call in parsed.tool_calls]
    return {"content": parsed.content or None, "tool_calls": calls}, "tool_calls"


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def response_body(req: ServeRequest, model: str, outputs: list[RequestOutput], tokenizer) -> dict:
    """The non-streaming answer: one choice per (prompt, sample), index ``prompt * n + sample``."""
    choices = []
    for p, out in enumerate(outputs):
        for sample in out.outputs:
            choice: dict[str, Any] = {
                "index": p * req.n + sample.index,
                "finish_reason": sample.finish_reason,
            }
            if req.endpoint == CHAT:
                message, choice["finish_reason"] = assistant_answer(
                    sample.text, sample.finish_reason, req.tool_parser
                )
                choice["message"] = {"role": "assistant", **message}
                choice["logprobs"] = (
                    chat_logprobs(tokenizer, sample.token_ids, sample.logprobs, sample.top_logprobs)
                    if req.logprobs
                    else None
                )
            else:
                choice["text"] = sample.text
                choice["logprobs"] = (
                    completion_logprobs(tokenizer, sample.token_ids, sample.logprobs, 0, sample.top_logprobs)
                    if req.logprobs
                    else None
                )
            choices.append(choice)
    return {
        "id": req.request_id,
        "object": "chat.completion" if req.endpoint == CHAT else "text_completion",
        "created": req.created,
        "model": model,
        "choices": choices,
        "usage": usage(outputs),
    }


def chunk_body(req: ServeRequest, model: str, choices: list[dict], usage_: dict | None = None) -> dict:
    body = {
        "id": req.request_id,
        "object": "chat.completion.chunk" if req.endpoint == CHAT else "text_completion",
        "created": req.created,
        "model": model,
        "choices": choices,
    }
    if req.include_usage:
        body["usage"] = usage_
    return body


def chunk_choice(
    req: ServeRequest,
    tokenizer,
    index: int,
    text: str,
    token_ids: list[int],
    logprobs: list[float],
    finish_reason: str | None,
    text_offset: int = 0,
    tops: list[Alternatives] | None = None,
) -> dict:
    """One choice of a streamed chunk: the text and the tokens sampled since the previous chunk (with
    their alternatives, ``tops``, when the request asks for them). With a tool parser the text comes
    whole in the last chunk (``text`` then holds all of it), with any ``tool_calls``."""
    choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason}
    if req.endpoint == CHAT and req.tool_parser is not None:
        choice["delta"] = {}
        if finish_reason is not None:
            message, choice["finish_reason"] = assistant_answer(text, finish_reason, req.tool_parser)
            calls = [{"index": k, **call} for k, call in enumerate(message.get("tool_calls", []))]
            choice["delta"] = {"content": message["content"], **({"tool_calls": calls} if calls else {})}
        choice["logprobs"] = (
            chat_logprobs(tokenizer, token_ids, logprobs, tops) if req.logprobs and token_ids else None
        )
    elif req.endpoint == CHAT:
        choice["delta"] = {"content": text} if text or finish_reason is None else {}
        choice["logprobs"] = (
            chat_logprobs(tokenizer, token_ids, logprobs, tops) if req.logprobs and token_ids else None
        )
    else:
        choice["text"] = text
        choice["logprobs"] = (
            completion_logprobs(tokenizer, token_ids, logprobs, text_offset, tops) if req.logprobs else None
        )
    return choice


def streamable_text(text: str, stops: list[str]) -> str:
    """The part of a growing completion that is safe to send: no half-decoded character at the end
    (shown as U+FFFD), and not the last characters that could still begin a stop string (the text is
    cut before a stop string, so those may never be sent)."""
    text = text.rstrip("\ufffd")
    hold = max((len(s) for s in stops), default=1) - 1
    return text[: len(text) - hold] if hold else text
