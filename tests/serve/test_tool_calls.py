"""``tools`` / ``tool_calls`` in ``tidal serve`` over loopback with the official ``openai`` client.

The served engine is scripted: it answers every request with a set text (encoded with the tiny
tokenizer), so a call's exact JSON is what the model "sampled", and it keeps the prompt ids it was given
(to check that the tools reached the chat template). The tokenizer is tidal.testing's with a Hermes-style
template that renders ``tools``, assistant ``tool_calls`` and ``role: "tool"`` messages.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from tidal.rollout import CompletionOutput, RequestOutput  # noqa: E402
from tidal.serve import OpenAIServer, RequestRecorder  # noqa: E402
from tidal.testing.tiny import build_tiny_tokenizer  # noqa: E402

MODEL = "tiny"
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t['function'] | tojson }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ {'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "sunny rainy weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
MESSAGES = [{"role": "user", "content": "the weather in Paris"}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


class ScriptedEngine:
    """The ``LLMEngine`` surface ``EngineLoop`` uses; every request finishes in one step with ``answer``."""

    def __init__(self, tokenizer):
        self.tokenizer, self.max_model_len = tokenizer, 512
        self.model = SimpleNamespace(args=SimpleNamespace(vocab_size=len(tokenizer)))
        self.answer = ""
        self.prompts: list[list[int]] = []
        self._pending: list[tuple[int, list[int], object]] = []

    def add_request(self, prompt_ids, params) -> int:
        self.prompts.append(list(prompt_ids))
        self._pending.append((len(self.prompts) - 1, list(prompt_ids), params))
        return len(self.prompts) - 1

    def has_unfinished(self) -> bool:
        return bool(self._pending)

    def abort(self, request_id) -> bool:
        return False

    def step(self, snapshot=None) -> list[RequestOutput]:
        outputs = []
        for request_id, prompt, params in self._pending:
            ids = self.tokenizer(self.answer, add_special_tokens=False)["input_ids"]
            samples = [
                CompletionOutput(k, self.answer, ids, [-0.5] * len(ids), "stop") for k in range(params.n)
            ]
            outputs.append(RequestOutput(request_id, None, prompt, samples))
        self._pending = []
        return outputs


@pytest.fixture(scope="module")
def served():
    tokenizer = build_tiny_tokenizer(None, add_bos=False)
    tokenizer.chat_template = HERMES_TEMPLATE
    engine = ScriptedEngine(tokenizer)
    recorder = RequestRecorder()
    with OpenAIServer(engine, MODEL, recorder=recorder) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        yield client, engine, recorder


def ask(served, answer: str, **kwargs):
    client, engine, _ = served
    engine.answer = answer
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=32, **kwargs)


def test_call_becomes_tool_calls_and_tools_reach_the_template(served):
    _, engine, recorder = served
    r = ask(served, "Let me check. " + CALL, tools=[WEATHER], user="episode-1")
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # the tool's description was rendered into the prompt the engine ran
    described = engine.tokenizer("sunny rainy weather", add_special_tokens=False)["input_ids"]
    prompt = engine.prompts[-1]
    assert any(prompt[i : i + len(described)] == described for i in range(len(prompt)))
    # the recording is token in, token out: the sampled ids, not the rewritten message
    (record,) = recorder.pop("episode-1")
    assert (
        record.samples[0].token_ids
        == engine.tokenizer(r"Let me check. " + CALL, add_special_tokens=False)["input_ids"]
    )


def test_only_a_call_has_null_content(served):
    (choice,) = ask(served, CALL, tools=[WEATHER]).choices
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "get_weather"


def test_malformed_call_stays_content(served):
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    (choice,) = ask(served, bad, tools=[WEATHER]).choices
    assert choice.message.content == bad and not choice.message.tool_calls
    assert choice.finish_reason == "stop"


def test_tool_choice_none_and_no_tools_do_not_parse(served):
    for kwargs in ({"tools": [WEATHER], "tool_choice": "none"}, {}):
        (choice,) = ask(served, CALL, **kwargs).choices
        assert choice.message.content == CALL and not choice.message.tool_calls
        assert choice.finish_reason == "stop"


def test_streaming_sends_the_calls_in_the_last_delta(served):
    chunks = list(ask(served, "Sure. " + CALL, tools=[WEATHER], stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "tool_calls" and all(f is None for f in finish[:-1])
    assert "".join(d.content or "" for d in deltas) == "Sure."
    (call,) = deltas[-1].tool_calls
    assert call.index == 0 and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_history_with_tool_calls_and_tool_results_renders(served):
    client, engine, _ = served
    engine.answer = "It is sunny."
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },  # fmt: skip
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=32)
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"
    # the template wrote the call with its arguments decoded into an object, then the tool's result
    template_call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    called = engine.tokenizer(template_call + "<|im_end|>\n<|im_start|>tool\nsunny", add_special_tokens=False)
    prompt = engine.prompts[-1]
    ids = called["input_ids"]
    assert any(prompt[i : i + len(ids)] == ids for i in range(len(prompt)))


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ],
)
def test_unsupported_tool_options_are_400(served, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        ask(served, CALL, tools=[WEATHER], **kwargs)
    assert err.value.body["param"] == param


def test_bad_tools_are_400(served):
    client, _, _ = served
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\] must be"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[{"type": "function"}])


def test_tools_need_a_template_with_a_call_format():
    from tidal.serve.protocol import ModelLimits, RequestError, parse_chat

    tokenizer = build_tiny_tokenizer(None, add_bos=False)  # its template renders no tool calls
    body = {"model": MODEL, "messages": MESSAGES, "tools": [WEATHER]}
    with pytest.raises(RequestError, match="shows no tool-call format"):
        parse_chat(body, tokenizer, ModelLimits(MODEL, 512))
    assert parse_chat({**body, "tool_choice": "none"}, tokenizer, ModelLimits(MODEL, 512)).tool_parser is None
    with pytest.raises(RequestError, match=r"tools\[0\] must be"):
        parse_chat({**body, "tools": ["get_weather"]}, tokenizer, ModelLimits(MODEL, 512))
