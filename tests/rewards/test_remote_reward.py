"""RemoteReward against tiny loopback HTTP servers: protocol, batch splitting, retries, failures."""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tidal.rewards import RemoteReward, RewardError


class RewardServer:
    """A loopback reward server: reward = len(query); ``fail_first`` requests answer ``fail_status``."""

    def __init__(
        self, fail_first: int = 0, fail_status: int = 500, reward_offset: float = 0.0, drop_last: bool = False
    ):
        self.requests: list[dict] = []
        self.drop_last = drop_last
        self.fail_first, self.fail_status, self.offset = fail_first, fail_status, reward_offset
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                if len(server.requests) <= server.fail_first:
                    self.send_response(server.fail_status)
                    self.end_headers()
                    self.wfile.write(b"busy")
                    return
                rewards = [len(q) + server.offset for q in body["query"]]
                if server.drop_last:
                    rewards = rewards[:-1]
                answer = {
                    "rewards": rewards,
                    "scores": [r / 10 for r in rewards],
                    "extra_logs": {"n": len(rewards)},
                }
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # keep test output quiet
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_reward"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


QUERIES = ["a", "bb", "ccc", "dddd", "eeeee"]
PROMPTS = ["p"] * 5
LABELS = ["1", "2", None, 4, "5"]


def test_protocol_and_result():
    with RewardServer() as server:
        result = RemoteReward([server.url])(QUERIES, PROMPTS, LABELS)
    assert server.requests == [{"query": QUERIES, "prompts": PROMPTS, "labels": LABELS}]
    assert result.rewards.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert result.scores.tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert result.extra_logs == {"n": 5.0}


def test_two_urls_split_the_batch_in_order():
    with RewardServer() as first, RewardServer(reward_offset=100.0) as second:
        result = RemoteReward(f"{first.url},{second.url}")(QUERIES, PROMPTS, LABELS)
    assert [r["query"] for r in first.requests] == [QUERIES[:3]]  # the first range takes the remainder
    assert [r["query"] for r in second.requests] == [QUERIES[3:]]
    assert [r["labels"] for r in second.requests] == [LABELS[3:]]
    assert result.rewards.tolist() == [1.0, 2.0, 3.0, 104.0, 105.0]
    assert result.extra_logs == pytest.approx({"n": (3 * 3 + 2 * 2) / 5})


def test_more_urls_than_samples():
    with RewardServer() as first, RewardServer() as second, RewardServer() as third:
        result = RemoteReward([first.url, second.url, third.url])(["xy", "z"], ["p", "p"], [1, 2])
    assert result.rewards.tolist() == [2.0, 1.0]
    assert len(first.requests) + len(second.requests) + len(third.requests) == 2


def test_retries_on_server_errors():
    with RewardServer(fail_first=2, fail_status=500) as server:
        result = RemoteReward([server.url], max_retries=3, backoff=0.01)(QUERIES, PROMPTS, LABELS)
    assert len(server.requests) == 3
    assert result.rewards.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_client_errors_fail_without_retry():
    with RewardServer(fail_first=10, fail_status=400) as server:
        url = server.url
        with pytest.raises(RewardError, match=rf"{url} answered HTTP 400: busy"):
            RemoteReward([url], max_retries=3, backoff=0.01)(QUERIES, PROMPTS, LABELS)
    assert len(server.requests) == 1


def test_dead_port_names_url_after_retries():
    with socket.socket() as sock:  # a port that was free a moment ago and has no listener now
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/get_reward"
    with pytest.raises(
        RewardError,
        match=rf"reward server {url} failed after 3 attempts, \d+ s in all; last error: .*refused",
    ):
        RemoteReward([url], max_retries=2, backoff=0.01, timeout=2)(QUERIES, PROMPTS, LABELS)


def test_wrong_length_answer_is_explained():
    with RewardServer(drop_last=True) as server:
        url = server.url
        with pytest.raises(RewardError, match=rf"reward server {url} returned rewards of length 4 for 5"):
            RemoteReward([url])(QUERIES, PROMPTS, LABELS)


def test_a_server_that_never_answers_is_reported_while_waiting(caplog):
    """A listening socket that is never read: connections complete (the kernel's backlog) and the request
    is sent, but no answer comes. While it waits, a line names the URL, the attempt and the time so far;
    each retried attempt says why; the end is one line."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/get_reward"
        reward = RemoteReward([url], timeout=1.0, max_retries=1, backoff=0.01, heartbeat=0.05)
        with caplog.at_level(logging.INFO, logger="tidal.rewards.remote"), pytest.raises(RewardError) as err:
            reward(QUERIES, PROMPTS, LABELS)
    message = str(err.value)
    assert "\n" not in message
    assert re.fullmatch(
        rf"reward server {re.escape(url)} did not answer within 1 s \(2 attempts, \d+ s in all\); check the "
        r"server or raise --remote_rm_timeout/--remote_rm_retries",
        message,
    ), message
    assert f"waiting for reward server {url}: attempt 1/2, " in caplog.text
    assert f"waiting for reward server {url}: attempt 2/2, " in caplog.text
    assert re.search(rf"reward server {re.escape(url)}: attempt 1/2 failed \(\w+: timed out\)", caplog.text)
