"""``tidal serve`` under attack (issue #30 §2), over loopback: one bad or slow request must never hurt the
other clients. Each test reproduces an attack and checks that it is refused (the right 4xx, never a
500) or contained, and that a good request alongside still gets its exact answer."""

from __future__ import annotations

import http.client
import json
import math
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from tidal.config.serve import ServeLimits  # noqa: E402
from tidal.rollout import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from tidal.serve import OpenAIServer  # noqa: E402

MODEL = "tiny"
LIMITS = ServeLimits(max_request_bytes=4096, max_request_samples=8, request_timeout=1.0)
POISON_TOP_K = 13  # the test engine fails every step while a request with this top_k is in it


def _engine(path) -> LLMEngine:
    return LLMEngine(path, EngineConfig(max_num_seqs=8, num_kv_blocks=160, max_model_len=1024))


@pytest.fixture(scope="module")
def ref(tiny_llama):
    return _engine(tiny_llama)


@pytest.fixture(scope="module")
def served(tiny_llama):
    engine = _engine(tiny_llama)
    advance = engine._advance
    engine.gate = threading.Event()  # cleared: the engine thread waits before its next step
    engine.gate.set()
    engine.hold_when = None  # a test's predicate: true once, it clears the gate (the engine holds there)

    def poisoned_advance():  # a request the engine cannot run (as top_k = 2**63 once was)
        if engine.hold_when is not None and engine.hold_when():
            engine.hold_when = None
            engine.gate.clear()
        assert engine.gate.wait(timeout=30)
        groups = [*engine.scheduler.waiting, engine.scheduler.running]
        if any(seq.params.top_k == POISON_TOP_K for group in groups for seq in group):
            raise OverflowError("Overflow when unpacking long long")
        return advance()

    engine._advance = poisoned_advance
    with OpenAIServer(engine, MODEL, limits=LIMITS) as server:
        yield server


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0)


def _post(server, path: str, payload=None, raw: bytes | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = raw if raw is not None else json.dumps(payload).encode()
    conn.request("POST", "/v1" + path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def _raw(server, data: bytes, close_write: bool = False) -> bytes:
    """Everything the server sends back on a connection given ``data`` (bounded by a 10 s timeout)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(data)
        if close_write:
            sock.shutdown(socket.SHUT_WR)
        return sock.makefile("rb").read()


def _wait_idle(engine) -> None:
    _poll(lambda: not engine.has_unfinished(), "the engine to finish")


def test_huge_top_k_is_no_longer_an_engine_failure(served, ref):
    payload = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 6, "seed": 1, "top_k": 2**63}
    status, body = _post(served, "/completions", payload)
    want = ref.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6, seed=1))[0].outputs[0]
    assert status == 200 and body["choices"][0]["text"] == want.text  # top_k >= vocab: no truncation
    status, body = _post(served, "/completions", {**payload, "top_k": -2})
    assert status == 400 and "'top_k' must be >= -1" in body["error"]["message"]


def test_failing_step_fails_only_the_request_it_blames(served, client, ref, caplog):
    """A good stream is in the engine when a request that breaks every step arrives: the step fails
    for both, the loop re-runs each alone, and only the bad one gets a 500; the good stream goes on
    and ends with exactly the tokens it would have had alone."""
    engine, loop = served.service.engine, served.service.loop
    prompt, params = "the number", dict(max_tokens=40, seed=3)
    want = ref.generate([ref.tokenizer.encode(prompt)], SamplingParams(max_new_tokens=40, seed=3))[0]
    assert len(want.outputs[0].token_ids) == 40  # the good request is still running when the bad one comes
    bad_payload = {"model": MODEL, "prompt": "x", "max_tokens": 4, "top_k": POISON_TOP_K}
    # The engine holds once the good request has 3 of its 40 tokens, until the bad one is queued.
    engine.hold_when = lambda: any(len(seq.output_token_ids) >= 3 for seq in engine.scheduler.running)
    with ThreadPoolExecutor(1) as pool:
        try:
            stream = client.completions.create(model=MODEL, prompt=prompt, stream=True, **params)
            _poll(lambda: not engine.gate.is_set(), "the good request to be under way")
            bad = pool.submit(_post, served, "/completions", bad_payload)
            _poll(lambda: loop._commands.qsize() > 0, "the bad request to be queued")
        finally:
            engine.hold_when = None
            engine.gate.set()
        text = "".join(chunk.choices[0].text for chunk in stream)
        status, body = bad.result(timeout=60)
    assert text == want.outputs[0].text
    assert status == 500 and "generation failed" in body["error"]["message"]
    assert "re-running each alone" in caplog.text  # the step failed with both requests in it
    assert client.completions.create(model=MODEL, prompt=prompt, **params).choices[0].text == text


def _poll(predicate, what: str) -> None:
    for _ in range(3000):  # bounded: about 30 s
        if predicate():
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_non_streaming_client_that_leaves_is_aborted(served):
    """The engine is held between two steps while the client leaves: the abort must reach the engine
    loop's queue then (before, the request generated its 2 × 1000 tokens for nobody)."""
    engine, loop = served.service.engine, served.service.loop
    request = {"model": MODEL, "prompt": "the", "max_tokens": 1000, "n": 2}
    sock = socket.create_connection(("127.0.0.1", served.port), timeout=10)
    body = json.dumps(request).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
    engine.gate.clear()
    try:
        sock.sendall(b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        _poll(engine.has_unfinished, "the request to reach the engine")
        sock.close()
        _poll(lambda: loop._commands.qsize() > 0, "the server to abort the request")
    finally:
        engine.gate.set()
    _wait_idle(engine)
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks


def test_samples_per_request_are_capped(served):
    status, body = _post(served, "/completions", {"model": MODEL, "prompt": "a", "n": 9})
    assert status == 400 and "--max_request_samples 8" in body["error"]["message"]
    status, body = _post(served, "/completions", {"model": MODEL, "prompt": ["a", "b", "c"], "n": 3})
    assert status == 400 and "3 prompts × n=3 asks for 9 samples" in body["error"]["message"]


def test_oversized_bodies_get_413_before_they_are_read(served):
    # A 50 MB announcement and a few bytes: the answer comes at once, so the length was checked first.
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    answer = _raw(served, head + b"Content-Length: 50000000\r\n\r\n{", close_write=True)
    assert answer.split()[1] == b"413" and b"--max_request_bytes 4096" in answer
    # Chunked (no length): refused once the bytes received pass the limit.
    chunk = b"x" * 1000
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(5))
    answer = _raw(served, head + b"Transfer-Encoding: chunked\r\n\r\n" + chunks, close_write=True)
    assert answer.split()[1] == b"413"
    # A client that sends its whole 200 kB body anyway still reads the 413 (the rest is dropped).
    status, body = _post(served, "/completions", {"model": MODEL, "prompt": "x" * 200_000})
    assert status == 413 and body["error"]["code"] == "request_too_large"


def test_health_answers_while_a_request_is_parsed(served):
    """Tokenizing runs off the event loop: with a request held inside its parsing, /health answers."""
    service, entered, release = served.service, threading.Event(), threading.Event()
    parse = service._parse

    def slow_parse(*args):
        entered.set()
        release.wait(timeout=30)
        return parse(*args)

    service._parse = slow_parse
    try:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(
                _post, served, "/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2}
            )
            assert entered.wait(timeout=30)
            conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
            conn.request("GET", "/health")
            assert conn.getresponse().status == 200
            conn.close()
            release.set()
            assert held.result(timeout=60)[0] == 200
    finally:
        service._parse = parse
        release.set()


BAD_BODIES = {
    "lone surrogate in a prompt": (b'{"model": "tiny", "prompt": "a\\ud800b"}', "not valid Unicode"),
    "lone surrogate in a message": (
        b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udc00"}]}',
        "not valid Unicode",
    ),
    "nested 100k deep": (b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nest"),
    "integer of 100k digits": (b'{"model": "tiny", "prompt": "a", "seed": ' + b"9" * 100_000 + b"}", "JSON"),
    "NaN": (b'{"model": "tiny", "prompt": "a", "temperature": NaN}', "not a JSON number"),
    "overflowing float": (b'{"model": "tiny", "prompt": "a", "temperature": 1e400}', "finite"),
    "temperature above 2": (b'{"model": "tiny", "prompt": "a", "temperature": 2.5}', "[0, 2]"),
}


@pytest.fixture(scope="module")
def big_body_server(tiny_llama):
    """A server taking 1 MiB bodies: the 100k-deep and 100k-digit bodies are 200 kB."""
    with OpenAIServer(_engine(tiny_llama), MODEL, limits=ServeLimits(max_request_bytes=1 << 20)) as server:
        yield server


@pytest.mark.parametrize("kind", list(BAD_BODIES))
def test_malformed_requests_are_400(kind, big_body_server):
    raw, fragment = BAD_BODIES[kind]
    path = "/chat/completions" if b"messages" in raw else "/completions"
    status, body = _post(big_body_server, path, raw=raw)
    assert status == 400 and fragment in body["error"]["message"], body


def test_tiny_temperature_is_greedy_and_never_nan(served, client, ref):
    ids = ref.tokenizer.encode("the")
    greedy = ref.generate([ids], SamplingParams(temperature=0, max_new_tokens=6, logprobs=2))[0].outputs[0]
    kwargs = dict(model=MODEL, prompt="the", max_tokens=6, temperature=1e-45, logprobs=2)
    choice = client.completions.create(**kwargs).choices[0]
    assert choice.text == greedy.text
    assert choice.logprobs.token_logprobs == pytest.approx(greedy.logprobs, abs=1e-5)
    assert all(math.isfinite(v) for top in choice.logprobs.top_logprobs for v in top.values())
    request = json.dumps({**kwargs, "stream": True}).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
    )
    answer = _raw(served, head + b"Content-Length: %d\r\n\r\n%s" % (len(request), request))
    assert b"data: [DONE]" in answer and b"NaN" not in answer and b"Infinity" not in answer


def test_partial_headers_and_stalled_bodies_time_out(served, client):
    answer = _raw(served, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never finished: 1 s deadline
    assert answer.split()[1] == b"408"
    stalled = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
    head, _, body = _raw(served, stalled).partition(b"\r\n\r\n")
    assert head.split()[1] == b"408" and "--request_timeout" in json.loads(body)["error"]["message"]
    assert client.completions.create(model=MODEL, prompt="a", max_tokens=2).usage.completion_tokens == 2
