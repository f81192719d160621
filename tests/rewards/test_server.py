"""Reward server over real HTTP on 127.0.0.1: correct per-request rewards under concurrency (32
clients), coalesced and interleaved micro-batches, 413 for oversized requests, 400 with a one-line JSON
error for every kind of malformed body while serving on, health check, CLI flags."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tidal.checkpoint import save_hf_model
from tidal.cli.serve_rm import main as serve_main
from tidal.cli.serve_rm import parse_config
from tidal.config import ConfigError, ModelConfig
from tidal.distributed import World
from tidal.models import load_tokenizer
from tidal.models.value_model import load_value_model, reward_config
from tidal.rewards.server import LISTEN_BACKLOG, RequestLimits, RewardScorer, RewardServer, fair_shares, serve

QUERIES = [
    f"{a}+{b}={a + b}" for a, b in [(1, 2), (10, 20), (3, 4), (55, 5), (7, 8), (90, 9), (12, 1), (4, 40)]
]


@pytest.fixture(scope="module")
def rm_path(tiny_llama, tmp_path_factory):
    """An (untrained) reward model folder with normalisation stats, as tidal rm writes it."""
    tokenizer = load_tokenizer(str(tiny_llama))
    model = load_value_model(ModelConfig(pretrain=str(tiny_llama)), torch.device("cpu"))
    out = tmp_path_factory.mktemp("rm")
    return save_hf_model(model, tokenizer, out, World(), reward_config(model, tokenizer, 0.25, 2.0))


@pytest.fixture(scope="module")
def scorer(rm_path):
    """The server's scorer loaded on its own, to score queries one by one as the reference."""
    return RewardScorer.load(parse_config(["--reward_pretrain", str(rm_path)]), torch.device("cpu"))


@pytest.fixture(scope="module")
def server(rm_path):
    srv = serve(parse_config(["--reward_pretrain", str(rm_path), "--port", "0", "--batch_size", "4"]))
    srv.start()
    yield srv
    srv.close()


def post(url, payload, raw: bytes | None = None):
    """``(status, json)`` of a POST, 4xx/5xx included."""
    body = raw if raw is not None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def one_by_one(scorer: RewardScorer, queries):
    return [scorer([q])[0] for q in queries]


def test_concurrent_requests_get_their_own_rewards(server, scorer):
    want = one_by_one(scorer, QUERIES)
    requests = [QUERIES[i : i + 2] for i in range(0, len(QUERIES), 2)] + [QUERIES[::-1], QUERIES[3:4]]
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        answers = list(pool.map(lambda qs: post(server.url + "/get_reward", {"query": qs}), requests))
    for queries, (status, body) in zip(requests, answers, strict=True):
        assert status == 200
        expected = [want[QUERIES.index(q)] for q in queries]
        assert body["rewards"] == pytest.approx(expected, abs=1e-5)
        assert body["scores"] == body["rewards"] and body["extra_logs"] == {}


def test_waiting_requests_are_coalesced_into_one_forward(rm_path):
    scorer = RewardScorer.load(
        parse_config(["--reward_pretrain", str(rm_path), "--batch_size", "8"]), torch.device("cpu")
    )
    gate, calls = threading.Event(), []

    def gated(queries):
        calls.append(len(queries))
        gate.wait(timeout=30)  # hold the worker so the next requests queue up behind the first
        return scorer(queries)

    with RewardServer(gated, "127.0.0.1", 0, batch_size=8).start() as srv, ThreadPoolExecutor(5) as pool:
        first = pool.submit(post, srv.url + "/get_reward", {"query": QUERIES[:1]})
        while not calls:
            threading.Event().wait(0.01)
        rest = [
            pool.submit(post, srv.url + "/get_reward", {"query": QUERIES[1 + 2 * i : 3 + 2 * i]})
            for i in range(3)
        ]
        while srv.worker.jobs.qsize() < 3:
            threading.Event().wait(0.01)
        gate.set()
        answers = [first.result()] + [f.result() for f in rest]
    assert calls == [1, 6]
    got = [r for _, body in answers for r in body["rewards"]]
    assert got == pytest.approx(one_by_one(scorer, QUERIES[:7]), abs=1e-5)


def test_normalized_rewards_use_stored_stats(rm_path, server):
    cfg = parse_config(["--reward_pretrain", str(rm_path), "--normalize_reward"])
    normalized = RewardScorer.load(cfg, torch.device("cpu"))(QUERIES[:3])
    _, body = post(
        server.url + "/get_reward", {"query": QUERIES[:3], "prompts": ["p"] * 3, "labels": [1, 2, 3]}
    )
    assert normalized == pytest.approx([(r - 0.25) / 2.0 for r in body["rewards"]], abs=1e-5)


def test_encode_matches_training_tokenization(scorer):
    tok = scorer.tokenizer
    want = tok("1+2=3" + tok.eos_token)["input_ids"]  # plain-text RM data: bos + text + eos
    for query in ("1+2=3", "1+2=3" + tok.eos_token, "1+2=3" + tok.eos_token + tok.pad_token * 2 + "\n"):
        assert scorer.encode(query) == want
    assert (
        len(scorer.encode("1" * 5000)) == scorer.max_len and scorer.encode("1" * 5000)[-1] == tok.eos_token_id
    )


def echo_scores(items):
    """A stand-in scorer: the reward of ``"q<k>"`` is ``k`` (so answers show which query they belong to)."""
    return [float(q[1:]) for q in items]


@pytest.fixture(scope="module")
def small_server():
    """A model-free server with small limits (1 KB bodies, 5 queries)."""
    limits = RequestLimits(max_bytes=1024, max_queries=5)
    with RewardServer(echo_scores, "127.0.0.1", 0, batch_size=2, limits=limits).start() as srv:
        yield srv


def raw_post(server, body: bytes, length: str | None = None, send_body: bool = True):
    """``(status, error line)`` of a POST written by hand (headers and body exactly as given)."""
    host, port = server.httpd.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.putrequest("POST", "/get_reward")
    conn.putheader("Content-Length", str(len(body)) if length is None else length)
    conn.endheaders(body if send_body else None)
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, json.loads(text)["error"]


BAD_BODIES = {
    "invalid JSON": (b"{not json", "not valid JSON"),
    "deeply nested": (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    "non-UTF-8": (b'{"query": ["\xff\xfe"]}', "not valid JSON"),
    "lone surrogate": (b'{"query": ["\\ud800"]}', "not valid Unicode"),
    "huge integer": (b'{"query": [' + b"9" * 5000 + b"]}", "not valid JSON"),
    "not an object": (b"[1, 2]", "JSON object"),
    "null": (b"null", "JSON object"),
    "no query": (b'{"prompts": ["a"]}', '"query" must be a list of strings'),
    "query a string": (b'{"query": "1+1=2"}', '"query" must be a list of strings'),
    "query an object": (b'{"query": {"a": "b"}}', '"query" must be a list of strings'),
    "query with a number": (b'{"query": ["a", 3]}', '"query" must be a list of strings'),
    "query with a list": (b'{"query": [["a"]]}', '"query" must be a list of strings'),
    "labels too short": (b'{"query": ["a", "b"], "labels": [1]}', '"labels" must be a list with one entry'),
    "prompts not a list": (b'{"query": ["a"], "prompts": "p"}', '"prompts" must be a list with one entry'),
}


@pytest.mark.parametrize("kind", list(BAD_BODIES))
def test_malformed_bodies_get_400_with_one_line_and_serving_continues(server, kind):
    body, message = BAD_BODIES[kind]
    status, error = raw_post(server, body)
    assert status == 400 and message in error and "\n" not in error
    ok_status, ok = post(server.url + "/get_reward", {"query": QUERIES[:2]})
    assert ok_status == 200 and len(ok["rewards"]) == 2


def test_bad_length_header_and_truncated_body_get_400(small_server):
    assert raw_post(small_server, b'{"query": ["q1"]}', length="12abc")[0] == 400
    host, port = small_server.httpd.server_address[:2]
    with socket.create_connection((host, port), timeout=10) as sock:  # announces 100 bytes, sends 10
        sock.sendall(b"POST /get_reward HTTP/1.0\r\nContent-Length: 100\r\n\r\n" + b'{"query": ')
        sock.shutdown(socket.SHUT_WR)
        head, _, body = sock.makefile("rb").read().partition(b"\r\n\r\n")
    assert head.split()[1] == b"400" and "ended after 10 of 100 bytes" in json.loads(body)["error"]


def test_oversized_requests_get_413_before_the_body_is_read(small_server):
    url = small_server.url + "/get_reward"
    status, body = post(url, {"query": ["q1" + "x" * 2000]})  # 2 KB: sent whole, refused, drained
    assert status == 413 and "--max_request_bytes 1024" in body["error"]
    # A 1 TB announcement with no body at all: answered at once, so the length was checked first.
    status, error = raw_post(small_server, b"", length=str(10**12), send_body=False)
    assert status == 413 and "--max_request_bytes" in error
    status, body = post(url, {"query": [f"q{i}" for i in range(6)]})
    assert status == 413 and "--max_request_queries 5" in body["error"]
    assert post(url, {"query": [f"q{i}" for i in range(5)]}) == (
        200,
        {"rewards": [0.0, 1.0, 2.0, 3.0, 4.0], "scores": [0.0, 1.0, 2.0, 3.0, 4.0], "extra_logs": {}},
    )


def test_http_server_errors_are_json(small_server):
    host, port = small_server.httpd.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.request("PUT", "/get_reward", body=b"{}")
    resp = conn.getresponse()
    assert resp.status == 501 and "PUT" in json.loads(resp.read())["error"]
    conn.close()


def test_scoring_failure_is_a_one_line_500_for_its_requests_only():
    def flaky(items):
        if "q13" in items:
            raise RuntimeError("CUDA out of memory.\nTried to allocate 2 GiB")
        return echo_scores(items)

    with RewardServer(flaky, "127.0.0.1", 0, batch_size=2).start() as srv:
        status, body = post(srv.url + "/get_reward", {"query": ["q12", "q13"]})
        assert status == 500 and body["error"] == "RuntimeError: CUDA out of memory. Tried to allocate 2 GiB"
        assert post(srv.url + "/get_reward", {"query": ["q12", "q14"]})[1]["rewards"] == [12.0, 14.0]


def test_fair_shares_split_a_micro_batch_round_robin():
    assert fair_shares([100, 1], 4) == [3, 1]
    assert fair_shares([100, 100], 4) == [2, 2]
    assert fair_shares([0, 5, 1, 9], 8) == [0, 4, 1, 3]
    assert fair_shares([3, 3, 3, 3, 3], 2) == [1, 1, 0, 0, 0]
    assert fair_shares([2, 1], 16) == [2, 1]


def wait_until(predicate, what: str) -> None:
    """Poll ``predicate`` (bounded: fails after about 30 s instead of hanging)."""
    for _ in range(3000):
        if predicate():
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_large_request_is_interleaved_so_a_small_one_finishes_first():
    batches, first_started, release, small_answered = (
        [],
        threading.Event(),
        threading.Event(),
        threading.Event(),
    )

    def instrumented(items):
        batches.append(list(items))
        if len(batches) == 1:
            first_started.set()
            release.wait(timeout=30)  # hold the worker until the small request is queued
        elif len(batches) == 3:
            small_answered.wait(timeout=30)  # the large request cannot finish before the small one
        return echo_scores(items)

    big_queries = [f"q{i}" for i in range(10, 22)]  # 12 queries: three micro-batches of 4 on its own
    with (
        RewardServer(instrumented, "127.0.0.1", 0, batch_size=4).start() as srv,
        ThreadPoolExecutor(2) as pool,
    ):
        big = pool.submit(post, srv.url + "/get_reward", {"query": big_queries})
        assert first_started.wait(timeout=30)
        small = pool.submit(post, srv.url + "/get_reward", {"query": ["q7"]})
        wait_until(lambda: srv.worker.jobs.qsize() == 1, "the small request to queue")
        release.set()
        small_answer = small.result(timeout=30)
        big_was_done = big.done()
        small_answered.set()
        big_answer = big.result(timeout=30)
    assert small_answer == (200, {"rewards": [7.0], "scores": [7.0], "extra_logs": {}})
    assert not big_was_done
    assert big_answer[0] == 200 and big_answer[1]["rewards"] == [float(q[1:]) for q in big_queries]
    assert [len(b) for b in batches] == [4, 4, 4, 1] and "q7" in batches[1]
    assert sorted(q for b in batches for q in b) == sorted(big_queries + ["q7"])


def test_32_concurrent_clients_get_correct_scores(server, scorer):
    assert server.httpd.request_queue_size == LISTEN_BACKLOG >= 1024
    want = dict(zip(QUERIES, one_by_one(scorer, QUERIES), strict=True))

    def client(k):
        answers = []
        for r in range(3):  # each client: three requests of 1-3 queries
            queries = [QUERIES[(k + r + j) % len(QUERIES)] for j in range(1 + (k + r) % 3)]
            answers.append((queries, post(server.url + "/get_reward", {"query": queries})))
        return answers

    with ThreadPoolExecutor(max_workers=32) as pool:
        results = [a for answers in pool.map(client, range(32)) for a in answers]
    assert len(results) == 96
    for queries, (status, body) in results:
        assert status == 200
        assert body["rewards"] == pytest.approx([want[q] for q in queries], abs=1e-5)


def test_health_unknown_path_and_missing_length(server):
    with urllib.request.urlopen(server.url + "/health", timeout=10) as resp:
        assert resp.status == 200 and json.loads(resp.read()) == {"status": "ok"}
    assert post(server.url + "/score", {"query": ["a"]})[0] == 404
    host, port = server.httpd.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.putrequest("POST", "/get_reward")
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 411 and "Content-Length" in json.loads(resp.read())["error"]
    conn.close()
    assert post(server.url + "/get_reward", {"query": []}) == (
        200,
        {"rewards": [], "scores": [], "extra_logs": {}},
    )


def test_cli_rejects_bad_flags(rm_path, tmp_path, capsys):
    with pytest.raises(ConfigError, match="--batch_size"):
        parse_config(["--reward_pretrain", str(rm_path), "--batch_size", "0"])
    with pytest.raises(ConfigError, match="--max_request_queries must be >= 1"):
        parse_config(["--reward_pretrain", str(rm_path), "--max_request_queries", "0"])
    cfg = parse_config(["--reward_pretrain", str(rm_path), "--max_request_bytes", "2048"])
    assert cfg.limits == RequestLimits(max_bytes=2048, max_queries=8192)
    assert (
        parse_config(["--reward_pretrain", str(rm_path), "--request_timeout", "5"]).limits.read_timeout == 5
    )
    with pytest.raises(ConfigError, match="--request_timeout"):
        parse_config(["--reward_pretrain", str(rm_path), "--request_timeout", "0"])
    with pytest.raises(SystemExit) as exc:
        serve_main(["--reward_pretrain", str(tmp_path / "missing"), "--port", "0"])
    assert exc.value.code == 2 and "--reward_pretrain" in capsys.readouterr().err


@pytest.fixture
def quick_timeout_server():
    """A model-free server whose clients may stay silent for 0.5 s only (``--request_timeout 0.5``)."""
    limits = RequestLimits(max_bytes=1024, max_queries=5, read_timeout=0.5)
    with RewardServer(echo_scores, "127.0.0.1", 0, batch_size=2, limits=limits).start() as srv:
        yield srv


def test_stalled_body_gets_408_and_serving_continues(quick_timeout_server):
    host, port = quick_timeout_server.httpd.server_address[:2]
    with socket.create_connection((host, port), timeout=10) as sock:  # announces 100 bytes, sends 10, waits
        sock.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b'{"query": ')
        head, _, body = sock.makefile("rb").read().partition(b"\r\n\r\n")
    assert head.split()[1] == b"408" and "--request_timeout" in json.loads(body)["error"]
    assert post(quick_timeout_server.url + "/get_reward", {"query": ["q3"]})[1]["rewards"] == [3.0]


def test_client_that_hangs_up_leaves_no_traceback(caplog, capfd):
    """The client resets its connection while its request is scored: the answer cannot be written, which
    is logged at debug level, not as a BrokenPipe/ConnectionReset traceback on stderr."""
    scoring, release = threading.Event(), threading.Event()

    def slow(items):
        scoring.set()
        release.wait(timeout=30)
        return echo_scores(items)

    caplog.set_level("DEBUG", logger="tidal.rewards.server")
    with RewardServer(slow, "127.0.0.1", 0, batch_size=2).start() as srv:
        host, port = srv.httpd.server_address[:2]
        body = b'{"query": ["q1"]}'
        sock = socket.create_connection((host, port), timeout=10)
        sock.sendall(
            b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        assert scoring.wait(timeout=30)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
        sock.close()
        release.set()
        wait_until(lambda: "went away" in caplog.text, "the server to notice the client left")
        assert post(srv.url + "/get_reward", {"query": ["q2"]})[1]["rewards"] == [2.0]
    assert "Traceback" not in capfd.readouterr().err
