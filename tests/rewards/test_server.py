"""Reward server over real HTTP on 127.0.0.1: correct per-request rewards under concurrency, coalesced
batches, 4xx on malformed requests while serving on, health check, CLI flags."""

from __future__ import annotations

import http.client
import json
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
from tidal.rewards.server import RewardScorer, RewardServer, serve

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


def test_concurrent_requests_get_their_own_rewards(server):
    scorer = server.worker.score
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


def test_encode_matches_training_tokenization(server):
    scorer = server.worker.score
    tok = scorer.tokenizer
    want = tok("1+2=3" + tok.eos_token)["input_ids"]  # plain-text RM data: bos + text + eos
    for query in ("1+2=3", "1+2=3" + tok.eos_token, "1+2=3" + tok.eos_token + tok.pad_token * 2 + "\n"):
        assert scorer.encode(query) == want
    assert (
        len(scorer.encode("1" * 5000)) == scorer.max_len and scorer.encode("1" * 5000)[-1] == tok.eos_token_id
    )


@pytest.mark.parametrize(
    ("payload", "raw", "status", "message"),
    [
        (None, b"{not json", 400, "not valid JSON"),
        ({"prompts": ["a"]}, None, 400, '"query" must be a list of strings'),
        ({"query": "1+1=2"}, None, 400, '"query" must be a list of strings'),
        ({"query": ["a", 3]}, None, 400, '"query" must be a list of strings'),
        ({"query": ["a", "b"], "labels": [1]}, None, 400, '"labels" must be a list with one entry per query'),
        (None, b"[1, 2]", 400, "JSON object"),
    ],
)
def test_malformed_requests_get_4xx_and_serving_continues(server, payload, raw, status, message):
    got_status, body = post(server.url + "/get_reward", payload, raw)
    assert got_status == status and message in body["error"]
    ok_status, ok = post(server.url + "/get_reward", {"query": QUERIES[:2]})
    assert ok_status == 200 and len(ok["rewards"]) == 2


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
    with pytest.raises(SystemExit) as exc:
        serve_main(["--reward_pretrain", str(tmp_path / "missing"), "--port", "0"])
    assert exc.value.code == 2 and "--reward_pretrain" in capsys.readouterr().err
