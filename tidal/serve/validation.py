"""Request validation: an OpenAI request body (a dict) → a ``ServeRequest`` the engine can run.

A request is checked field by field, every value's type and range before anything reaches the engine;
anything tidal cannot honour is a ``RequestError`` (HTTP 400) naming the field and what was expected,
never silently ignored: e.g. ``presence_penalty`` other than 0, ``logit_bias``, ``tool_choice:
"required"``, ``echo``. Unknown fields are refused too; ``store`` is accepted and has no effect
(OpenAI keeps stored completions for its dashboard; a tidal server keeps nothing).

Ranges follow OpenAI where it has the field: ``temperature`` in [0, 2] (finite), ``top_p`` in (0, 1],
``top_logprobs`` 0..20, completions ``logprobs`` 0..5, at most ``MAX_STOP`` stop strings. A
``temperature`` below ``GREEDY_BELOW`` (vLLM's sampling epsilon) is greedy, as in vLLM: dividing
logits by a smaller one overflows float32 (NaN log-probs, garbage tokens). ``top_k`` (vLLM's field) is
-1/0 (off) or >= 1, and a value at or above the vocabulary size is off too, so no huge integer reaches
the engine. A request asks for at most ``--max_request_samples`` samples (prompts × ``n``).

Lengths follow vLLM: a request whose prompt plus ``max_tokens`` exceeds the context length is refused
with both numbers; without ``max_tokens`` the completion may use the rest of the context (or the
server's ``--default_max_tokens``). Tools: see ``tidal.serve.protocol``; images (``image_url`` parts,
vision-language models): ``tidal.serve.images``.
"""

from __future__ import annotations

import json
import math
from typing import Any

from tidal.data.tool_parsers import detect_tool_parser
from tidal.rollout import SamplingParams
from tidal.serve.images import ChatImages, image_part_url
from tidal.serve.schema import CHAT, COMPLETIONS, ModelLimits, RequestError, ServeRequest

# Accepted fields; those marked in _NEUTRAL are accepted only at their no-op value.
_SAMPLING_FIELDS = {"model", "n", "temperature", "top_p", "top_k", "max_tokens", "stop", "seed", "stream"}
_SAMPLING_FIELDS |= {"stream_options", "user", "presence_penalty", "frequency_penalty", "logit_bias"}
_CHAT_FIELDS = _SAMPLING_FIELDS | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}
_CHAT_FIELDS |= {"tools", "tool_choice", "parallel_tool_calls", "response_format", "store"}
_COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt", "logprobs", "echo", "best_of", "suffix"}
# field → (accepted no-op value, why another value is refused)
_NEUTRAL = {
    "presence_penalty": (0, "penalties are not supported"),
    "frequency_penalty": (0, "penalties are not supported"),
    "logit_bias": (None, "logit_bias is not supported"),
    "echo": (False, "echo (prompt log-probs) is not supported"),
    "suffix": (None, "suffix (insertion) is not supported"),
    "parallel_tool_calls": (True, "false (at most one call per answer) is not supported"),
}
TOOL_CHOICES = ("none", "auto")
MAX_STOP = 16  # stop strings per request (each is searched for at every step); OpenAI allows 4
GREEDY_BELOW = 1e-5  # temperatures under this are greedy (vLLM's _SAMPLING_EPS)


# ---------------------------------------------------------------------------- field checks
def _number(body: dict, name: str, default, low=None, high=None, integer=False, low_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        shown = repr(value) if len(repr(value)) < 80 else f"{repr(value)[:40]}..."
        raise RequestError(
            f"'{name}' must be {'an integer' if integer else 'a number'}, got {shown}", param=name
        )
    if not math.isfinite(value):
        raise RequestError(f"'{name}' must be a finite number, got {value}", param=name)
    too_low = low is not None and (value <= low if low_open else value < low)
    if too_low or (high is not None and value > high):
        bounds = f"{'>' if low_open else '>='} {low}" if high is None else f"in [{low}, {high}]"
        raise RequestError(f"'{name}' must be {bounds}, got {value}", param=name)
    return value


def _check_fields(body: dict, allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(f"unsupported field(s): {', '.join(unknown)}", param=unknown[0])
    for name, (neutral, why) in _NEUTRAL.items():
        value = body.get(name)
        if name in allowed and value is not None and value != neutral and value != {} and value != []:
            raise RequestError(f"'{name}': {why}", param=name)


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("'stop' must be a non-empty string or a list of non-empty strings", param="stop")
    if len(stops) > MAX_STOP:
        raise RequestError(f"'stop' may hold at most {MAX_STOP} strings, got {len(stops)}", param="stop")
    return stops


def _max_tokens(body: dict, prompt_len: int, limits: ModelLimits, names: tuple[str, ...]) -> int:
    given = [(name, body[name]) for name in names if body.get(name) is not None]
    name = given[0][0] if given else names[0]
    room = limits.max_model_len - prompt_len
    if room < 1:
        raise RequestError(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, your "
            f"prompt has {prompt_len} tokens, which leaves no room for a completion. Please shorten the prompt.",
            code="context_length_exceeded",
            param="messages" if "max_completion_tokens" in names else "prompt",
        )
    if not given:
        return min(room, limits.default_max_tokens or room)
    max_tokens = _number(body, name, None, low=1, integer=True)
    if prompt_len + max_tokens > limits.max_model_len:
        raise RequestError(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the completion). "
            f"Please reduce the length of the prompt or '{name}'.",
            code="context_length_exceeded",
            param=name,
        )
    return max_tokens


def _samples(body: dict, num_prompts: int, limits: ModelLimits) -> int:
    """``n``, checked with the prompt count against ``--max_request_samples`` (before any tokenizing)."""
    n = _number(body, "n", 1, low=1, integer=True)
    if n * num_prompts > limits.max_samples:
        what = f"n={n}" if num_prompts == 1 else f"{num_prompts} prompts × n={n}"
        raise RequestError(
            f"{what} asks for {n * num_prompts} samples, over the server's --max_request_samples "
            f"{limits.max_samples}; ask for fewer per request",
            param="n",
        )
    return n


def _sampling(
    body: dict, max_tokens: int, n: int, top_logprobs: int, vocab_size: int | None
) -> SamplingParams:
    seed = _number(body, "seed", None, integer=True)
    try:
        return _params(body, max_tokens, n, seed, top_logprobs, vocab_size)
    except ValueError as err:  # anything the field checks above let through
        raise RequestError(str(err).replace("SamplingParams: ", "")) from err


def _params(
    body: dict, max_tokens: int, n: int, seed: int | None, top_logprobs: int, vocab_size: int | None
) -> SamplingParams:
    temperature = _number(body, "temperature", 1.0, low=0, high=2)
    top_k = _number(body, "top_k", -1, low=-1, integer=True)
    if top_k >= (vocab_size or 2**31):  # keeps every token: off (and no huge int reaches the engine)
        top_k = -1
    return SamplingParams(
        n=n,
        temperature=0.0 if temperature < GREEDY_BELOW else temperature,
        top_p=_number(body, "top_p", 1.0, low=0, high=1, low_open=True),
        top_k=top_k,
        max_new_tokens=max_tokens,
        stop=_stop(body),
        seed=None if seed is None else seed % 2**64,
        logprobs=top_logprobs or None,  # 0: the engine computes no alternatives
    )


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise RequestError("'stream_options' is only allowed with 'stream': true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise RequestError("'stream_options' may only hold 'include_usage'", param="stream_options")
    return stream, bool(options.get("include_usage", False))


def _episode(body: dict, header: str | None) -> str | None:
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError("'user' must be a string", param="user")
    return header or user


def check_model(body: dict, limits: ModelLimits) -> None:
    model = body.get("model")
    if not isinstance(model, str):
        raise RequestError("'model' is required: the model id from /v1/models", param="model")
    if model != limits.name:
        raise RequestError(
            f"The model '{model}' does not exist; this server serves '{limits.name}'",
            status=404,
            code="model_not_found",
            param="model",
        )


# ---------------------------------------------------------------------------- requests
def message_text(index: int, message: Any, images: list[tuple[str, dict]] | None = None) -> dict:
    """One chat message as the template sees it: role and content, plain text, or (when it holds
    ``image_url`` parts) a list of ``{"type": "text"}`` and ``{"type": "image"}`` parts. Each image
    part is appended to ``images`` as ``(where, part)``; without that list image parts are refused."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(f"messages[{index}] must be an object with a 'role'", param="messages")
    content = message.get("content")
    if isinstance(content, list):
        content = _content_parts(index, content, images)
    if content is not None and not isinstance(content, (str, list)):
        raise RequestError(
            f"messages[{index}].content must be a string or a list of content parts", param="messages"
        )
    rendered = {**message, "content": content or ""}
    if message.get("tool_calls") is not None:
        rendered["tool_calls"] = _template_tool_calls(index, message["tool_calls"])
    if message["role"] == "tool" and not isinstance(message.get("tool_call_id", ""), str):
        raise RequestError(f"messages[{index}].tool_call_id must be a string", param="messages")
    return rendered


def _content_parts(index: int, parts: list, images: list[tuple[str, dict]] | None) -> str | list[dict]:
    """Text parts joined into a string; with ``image_url`` parts, the template's list of parts."""
    kinds = ("text", "image_url") if images is not None else ("text",)
    rendered: list[dict] = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            raise RequestError(
                f"messages[{index}].content[{j}]: only {' and '.join(repr(k) for k in kinds)} content parts "
                f"are supported, got {kind!r}",
                param="messages",
            )
        if kind == "text":
            rendered.append({"type": "text", "text": str(part.get("text", ""))})
        else:
            images.append((f"messages[{index}].content[{j}]", part))  # read once the model is known to see
            rendered.append({"type": "image"})
    if all(p["type"] == "text" for p in rendered):
        return "".join(p["text"] for p in rendered)  # as before images: one string
    return rendered


def _template_tool_calls(index: int, calls: Any) -> list[dict]:
    """An assistant message's OpenAI ``tool_calls`` as chat templates read them: the arguments decoded
    into an object (Hermes/Qwen and Llama 3 templates write them with ``tojson``; as vLLM does)."""
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise RequestError(f"{where} must be a list", param="messages")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(
                f"{where}[{j}] must be {{'function': {{'name', 'arguments'}}}}", param="messages"
            )
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError:
                raise RequestError(
                    f"{where}[{j}].function.arguments is not a JSON string: {arguments[:80]!r}",
                    param="messages",
                ) from None
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def _tools(body: dict) -> list[dict] | None:
    """``tools``: a list of ``{"type": "function", "function": {"name", ...}}`` (None when absent/empty)."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list of {'type': 'function', 'function': {...}}", param="tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function" or not function.get("name"):
            raise RequestError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name', 'description', 'parameters'}}}}",
                param="tools",
            )
    return tools


def _tool_parser(body: dict, tokenizer, tools: list[dict] | None) -> str | None:
    """The parser answers go through: none without tools or with ``tool_choice: "none"``."""
    choice = body.get("tool_choice")
    if choice is not None and choice not in TOOL_CHOICES:
        raise RequestError(
            f"'tool_choice' must be one of {list(TOOL_CHOICES)} ('required' and a named function are not "
            f"supported: the engine cannot force a call), got {choice!r}",
            param="tool_choice",
        )
    if tools is None or choice == "none":
        return None
    parser = detect_tool_parser(getattr(tokenizer, "chat_template", None))
    if parser is None:
        raise RequestError(
            "'tools': the served model's chat template shows no tool-call format (Hermes/Qwen <tool_call> "
            "or Llama 3 JSON), so calls could not be parsed; use --tokenizer_chat_template",
            param="tools",
        )
    return parser


def chat_messages(messages: Any, images: list[tuple[str, dict]] | None = None) -> list[dict]:
    """The messages as the chat template reads them (``message_text``); ``images`` (a list) collects
    the ``image_url`` parts."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    return [message_text(i, m, images) for i, m in enumerate(messages)]


def chat_prompt_ids(tokenizer, messages: Any, tools: list[dict] | None = None, images=None) -> list[int]:
    """Render messages (and ``tools``) with the tokenizer's chat template (with the generation prompt)
    into ids (messages already rendered by ``chat_messages`` are taken as they are); ``images``
    (``(ChatImages, OpenedImages)``) lays the images out in the text as the model's processor does."""
    text = chat_prompt_text(tokenizer, messages, tools)
    if images is not None:
        text = images[0].expand_text(text, images[1])
    # The template writes any bos itself; encoding must not add a second one.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def chat_prompt_text(tokenizer, messages: Any, tools: list[dict] | None = None) -> str:
    """``chat_prompt_ids``'s text, before images are laid out and it is encoded."""
    rendered = messages if _rendered(messages) else chat_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError(
            "the served model's tokenizer has no chat template: use /v1/completions, or start the server "
            "with --tokenizer_chat_template"
        )
    try:
        extra = {} if tools is None else {"tools": tools}  # as before when there are none
        return tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False, **extra)
    except Exception as err:  # a template may raise on a message order it does not allow
        raise RequestError(f"the chat template rejected the messages: {err}", param="messages") from err


def _prompt_list(prompt: Any) -> list:
    """``prompt`` as a list of prompts (a string or a list of token ids is one prompt)."""
    if (
        isinstance(prompt, str)
        or isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise RequestError(
            "'prompt' must be a string, a list of strings or a list of token ids", param="prompt"
        )
    return prompt


def completion_prompt_ids(tokenizer, prompt: Any, vocab_size: int) -> list[list[int]]:
    """``prompt`` as a string, a list of strings, a list of token ids or a list of such lists."""
    prompts = []
    for i, p in enumerate(_prompt_list(prompt)):
        if isinstance(p, str):
            ids = tokenizer.encode(p)  # as the engine encodes text prompts (bos where the tokenizer adds one)
        elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            ids = list(p)
            if any(not 0 <= t < vocab_size for t in ids):
                raise RequestError(f"prompt {i} has token ids outside [0, {vocab_size})", param="prompt")
        else:
            raise RequestError(f"prompt {i} must be a string or a list of token ids", param="prompt")
        if not ids:
            raise RequestError(f"prompt {i} is empty", param="prompt")
        prompts.append(ids)
    return prompts


class _Rendered(list):
    """Messages already rendered by ``chat_messages``."""


def _rendered(messages: Any) -> bool:
    return isinstance(messages, _Rendered)


def _open_images(parts: list[tuple[str, dict]], images: ChatImages | None, limits: ModelLimits):
    """A request's images opened (headers only; None without images): they must go to a vision model,
    be few and small enough (checked before any pixel is decoded)."""
    if not parts:
        return None
    if images is None:
        raise RequestError(
            f"the model '{limits.name}' takes no images (it is not a vision-language model); send text "
            "content only",
            param="messages",
        )
    return images.open([(where, image_part_url(where, p)) for where, p in parts])


def parse_chat(
    body: dict,
    tokenizer,
    limits: ModelLimits,
    episode_header: str | None = None,
    images: ChatImages | None = None,
) -> ServeRequest:
    """A ``/v1/chat/completions`` body → ``ServeRequest``; ``images`` reads ``image_url`` parts (a
    vision-language model; None: a request with images is refused naming the model)."""
    _check_fields(body, _CHAT_FIELDS)
    check_model(body, limits)
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise RequestError("'response_format': only {'type': 'text'} is supported", param="response_format")
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise RequestError("'logprobs' must be a boolean", param="logprobs")
    top = _number(body, "top_logprobs", 0, low=0, high=20, integer=True)
    if top and not logprobs:
        raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if not isinstance(body.get("store", False), bool):
        raise RequestError("'store' must be a boolean", param="store")
    n = _samples(body, 1, limits)
    tools = _tools(body)
    tool_parser = _tool_parser(body, tokenizer, tools)
    parts: list[tuple[str, dict]] = []
    messages = _Rendered(chat_messages(body.get("messages"), parts))
    opened = _open_images(parts, images, limits)  # before the template: a text model's may not take parts
    # each image's marker laid out in the text with its token count (measured from its size, not yet
    # decoded), so the ids are the processor's and their length is the prompt's
    ids = chat_prompt_ids(tokenizer, messages, tools, None if opened is None else (images, opened))
    max_tokens = _max_tokens(body, len(ids), limits, ("max_completion_tokens", "max_tokens"))
    multi_modal = None if opened is None else images.pixel_input(opened)
    stream, include_usage = _stream_options(body)
    return ServeRequest(
        CHAT,
        [ids],
        _sampling(body, max_tokens, n, top, limits.vocab_size),
        stream,
        include_usage,
        logprobs,
        _episode(body, episode_header),
        tool_parser,
        multi_modal=None if multi_modal is None else [multi_modal],
    )


def parse_completion(
    body: dict, tokenizer, limits: ModelLimits, vocab_size: int, episode_header: str | None = None
) -> ServeRequest:
    """A ``/v1/completions`` body → ``ServeRequest`` (one engine request per prompt)."""
    _check_fields(body, _COMPLETION_FIELDS)
    check_model(body, limits)
    logprobs = body.get("logprobs")
    top = _number(body, "logprobs", 0, low=0, high=5, integer=True)
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise RequestError("'best_of' other than 'n' is not supported", param="best_of")
    prompt = _prompt_list(body.get("prompt"))
    n = _samples(body, len(prompt), limits)
    prompts = completion_prompt_ids(tokenizer, prompt, vocab_size)
    # One SamplingParams for the batch: without max_tokens each prompt gets the room the longest leaves.
    max_tokens = _max_tokens(body, max(len(p) for p in prompts), limits, ("max_tokens",))
    stream, include_usage = _stream_options(body)
    return ServeRequest(
        COMPLETIONS,
        prompts,
        _sampling(body, max_tokens, n, top, vocab_size),
        stream,
        include_usage,
        logprobs is not None,
        _episode(body, episode_header),
    )
