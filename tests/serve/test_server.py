"""``tidal serve`` over loopback with the official ``openai`` client: every answer is checked against
a second engine running the same request through ``LLMEngine.generate`` (same seed → same tokens,
since the engine's noise depends on the seed and position, not on the batch)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from tidal.rollout import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from tidal.serve import OpenAIServer, RequestRecorder  # noqa: E402

MODEL = "tiny"
MAX_LEN = 128
MESSAGES = [{"role": "user", "content": "What is 2+3?"}]


def _engine(path) -> LLMEngine:
    return LLMEngine(
        path, EngineConfig(max_num_seqs=16, num_kv_blocks=128, block_size=16, max_model_len=MAX_LEN)
    )


@pytest.fixture(scope="module")
def ref(tiny_llama):
    """The reference engine (never touched by the server)."""
    return _engine(tiny_llama)


@pytest.fixture(scope="module")
def served(tiny_llama):
    recorder = RequestRecorder()
    with OpenAIServer(_engine(tiny_llama), MODEL, recorder=recorder) as server:
        yield server, recorder


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].base_url, api_key="unused", max_retries=0)


def chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def expected(ref, ids, **params):
    return ref.generate([ids], SamplingParams(**params))[0].outputs


def test_list_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_chat_matches_engine_with_logprobs(client, ref):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, seed=7, temperature=0.8, logprobs=True, top_logprobs=0
    )
    (want,) = expected(ref, chat_ids(ref.tokenizer, MESSAGES), max_new_tokens=12, seed=7, temperature=0.8)
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == want.finish_reason
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(want.logprobs, abs=1e-5)
    assert [t.token for t in choice.logprobs.content] == [ref.tokenizer.decode([t]) for t in want.token_ids]
    assert r.usage.prompt_tokens == len(chat_ids(ref.tokenizer, MESSAGES))
    assert r.usage.completion_tokens == len(want.token_ids)


def test_completion_matches_engine_with_logprobs(client, ref):
    r = client.completions.create(model=MODEL, prompt="the number", max_tokens=10, seed=3, logprobs=0)
    (want,) = expected(ref, ref.tokenizer.encode("the number"), max_new_tokens=10, seed=3)
    (choice,) = r.choices
    assert choice.text == want.text
    assert choice.logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert r.usage.completion_tokens == 10 and choice.finish_reason == "length"


def test_completion_token_id_prompts_batch(client, ref):
    prompts = [[5, 6, 7], [8, 9]]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, seed=1, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    for c in r.choices:
        p, sample = divmod(c.index, 2)
        assert c.text == expected(ref, prompts[p], max_new_tokens=4, seed=1, n=2)[sample].text
    assert r.usage.prompt_tokens == 5


def test_chat_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=12, seed=11, logprobs=True)
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    logprobs = [
        t.logprob
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert text == full.choices[0].message.content
    assert logprobs == [t.logprob for t in full.choices[0].logprobs.content]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_completion_stream_n3(client, ref):
    ids = ref.tokenizer.encode("a digit")
    stream = client.completions.create(model=MODEL, prompt="a digit", max_tokens=6, n=3, seed=5, stream=True)
    texts = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    want = expected(ref, ids, max_new_tokens=6, n=3, seed=5)
    assert texts == {o.index: o.text for o in want}


def test_n3_choices(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, n=3, seed=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1  # three samples, not one copied
    assert r.usage.completion_tokens == 24


def _stop_case(client):
    """A stop string that occurs in the middle of an unstopped sample: (request kwargs, text, stop)."""
    kwargs = dict(model=MODEL, prompt="the answer is", max_tokens=24, seed=4)
    text = client.completions.create(**kwargs).choices[0].text
    stop = next(ch for ch in text[len(text) // 3 :] if ch.isalpha())
    return kwargs, text, stop


def test_stop_strings(client):
    kwargs, text, stop = _stop_case(client)
    cut = text[: text.index(stop)]
    r = client.completions.create(stop=[stop, "never-there"], **kwargs)
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=stop, stream=True, **kwargs))
    assert streamed == cut


def test_seed_reproducibility(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=1.0)
    a = client.chat.completions.create(seed=123, **kwargs).choices[0].message.content
    b = client.chat.completions.create(seed=123, **kwargs).choices[0].message.content
    c = client.chat.completions.create(seed=124, **kwargs).choices[0].message.content
    assert a == b and a != c


def test_concurrent_clients(served, ref):
    base_url = served[0].base_url
    prompts = ["one two", "the carry", "is it", "number of"]
    results: dict[int, object] = {}

    def ask(i: int) -> None:
        c = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        results[i] = c.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=10 + i, seed=i, logprobs=0
        )

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, prompt in enumerate(prompts):
        (want,) = expected(ref, ref.tokenizer.encode(prompt), max_new_tokens=10 + i, seed=i)
        choice = results[i].choices[0]
        assert choice.text == want.text
        assert choice.logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-4)


def test_beyond_context_length_is_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=list(range(5, 5 + MAX_LEN)), max_tokens=4)
    assert err.value.status_code == 400
    assert f"maximum context length is {MAX_LEN} tokens" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=[5] * 100, max_tokens=40)
    assert "you requested 140 tokens (100 in the prompt, 40 in the completion)" in err.value.message
    assert err.value.code == "context_length_exceeded"


def _post(url: str, data: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_malformed_and_unsupported_requests(served):
    base = served[0].base_url
    status, body = _post(base + "/chat/completions", b'{"model": "tiny", "messages": [')
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"
    cases = [
        ({"model": "tiny", "messages": MESSAGES, "top_logprobs": 21, "logprobs": True}, 400, "[0, 20]"),
        ({"model": "tiny", "messages": MESSAGES, "top_logprobs": 2}, 400, "needs 'logprobs': true"),
        ({"model": "tiny", "messages": MESSAGES, "presence_penalty": 0.5}, 400, "presence_penalty"),
        (
            {"model": "tiny", "messages": MESSAGES, "temperature": "hot"},
            400,
            "'temperature' must be a number",
        ),
        ({"model": "tiny", "messages": MESSAGES, "bogus": 1}, 400, "unsupported field(s): bogus"),
        ({"model": "tiny", "messages": []}, 400, "'messages' must be a non-empty list"),
        ({"model": "other", "messages": MESSAGES}, 404, "does not exist"),
    ]
    for payload, want_status, fragment in cases:
        status, body = _post(base + "/chat/completions", json.dumps(payload).encode())
        assert (status, fragment in body["error"]["message"]) == (want_status, True), body
    status, body = _post(
        base + "/completions", json.dumps({"model": "tiny", "prompt": "a", "logprobs": 6}).encode()
    )
    assert status == 400 and "'logprobs' must be in [0, 5]" in body["error"]["message"]


def test_recorder_keeps_episode_tokens(client, served):
    recorder = served[1]
    r1 = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=5,
        seed=9,
        logprobs=True,
        extra_headers={"X-Episode-Id": "ep-1"},
    )
    turn2 = [
        *MESSAGES,
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "and?"},
    ]
    stream = client.chat.completions.create(
        model=MODEL, messages=turn2, max_tokens=4, seed=9, stream=True, user="ep-1"
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    client.completions.create(model=MODEL, prompt="x", max_tokens=2)  # no episode: not recorded
    first, second = recorder.pop("ep-1")
    tokenizer = served[0].service.tokenizer
    assert first.prompt_token_ids == chat_ids(tokenizer, MESSAGES)
    (sample,) = first.samples
    assert sample.logprobs == [t.logprob for t in r1.choices[0].logprobs.content]
    assert tokenizer.decode(sample.token_ids, skip_special_tokens=True) == r1.choices[0].message.content
    assert sample.finish_reason == r1.choices[0].finish_reason
    assert second.prompt_token_ids == chat_ids(tokenizer, turn2) and second.order > first.order
    assert tokenizer.decode(second.samples[0].token_ids, skip_special_tokens=True) == streamed
    assert recorder.episode_ids() == []


def test_client_leaving_a_stream_aborts_its_samples(tiny_llama):
    """The stream would take ~1000 decode steps; the client leaves after two chunks, so the engine
    must drop both samples (nothing recorded, every KV block free) long before they could finish."""
    engine = LLMEngine(tiny_llama, EngineConfig(max_num_seqs=4, num_kv_blocks=160, max_model_len=1024))
    recorder = RequestRecorder()
    with OpenAIServer(engine, MODEL, recorder=recorder) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        stream = client.completions.create(
            model=MODEL, prompt="the", max_tokens=1000, n=2, stream=True, user="gone"
        )
        chunks = iter(stream)
        next(chunks), next(chunks)
        stream.response.close()
        done = threading.Event()
        while engine.has_unfinished():  # the abort reaches the engine thread between two steps
            done.wait(0.01)
        assert recorder.episode("gone") == []
        assert engine.block_manager.num_free_blocks == engine.num_kv_blocks


def test_openai_fidelity_models_ids_store_temperature(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, store=True)
    assert chat.id.startswith("chatcmpl-")
    assert client.completions.create(model=MODEL, prompt="a", max_tokens=2).id.startswith("cmpl-")
    for bad in (2.5, -0.1):
        with pytest.raises(openai.BadRequestError, match=r"\[0, 2\]"):
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=bad)


def test_stream_sends_no_empty_content_while_text_is_held_back(client):
    """A 4-character stop string holds the last 3 characters of the text back each step: the chunks of
    those steps are not sent as empty deltas; their tokens' log-probs come with the next text."""
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=24, seed=5, logprobs=True, stop=["zzzz"])
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0] for c in chunks[1:]]
    assert all(d.delta.content != "" for d in deltas)
    assert all(d.delta.content or d.finish_reason for d in deltas)
    assert "".join(d.delta.content or "" for d in deltas) == full.choices[0].message.content
    streamed = [t.logprob for d in deltas if d.logprobs for t in d.logprobs.content]
    assert streamed == [t.logprob for t in full.choices[0].logprobs.content]


def test_logprob_bytes_of_partial_utf8_tokens(ref):
    from tidal.serve.protocol import chat_logprobs

    tok = ref.tokenizer
    ids = tok.encode("héllo 世界", add_special_tokens=False)
    entries = chat_logprobs(tok, ids, [-1.0] * len(ids))["content"]
    assert any(e["token"] == "\ufffd" for e in entries)  # some tokens hold part of a character
    assert b"".join(bytes(e["bytes"]) for e in entries) == "héllo 世界".encode()
