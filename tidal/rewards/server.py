"""HTTP reward server (``tidal serve_rm``) for ``--remote_rm_url http://host:port/get_reward``.

Protocol (docs/architecture.md §5): ``POST /get_reward`` with JSON ``{"query": [str], "prompts": [str],
"labels": [...]}`` → ``{"rewards": [float], "scores": [float], "extra_logs": {}}``, one reward per
query, where a query is the full text (prompt + response). ``prompts`` and ``labels`` are optional;
when given they must be lists as long as ``query``; a reward model scores the query alone, so they
are only validated. ``scores`` equal the rewards (as OpenRLHF's server). ``GET /health`` answers
``{"status": "ok"}``. Malformed requests get a 4xx JSON ``{"error": ...}``; the server keeps serving.

Queries are tokenized like reward-model training data (``RewardScorer.encode``): trailing padding,
eos and whitespace are stripped and exactly one eos appended (as OpenRLHF), and a bos is prepended
when the tokenizer adds one to plain text and the text does not already start with it. A query
longer than ``--max_len`` tokens keeps its *last* ``max_len`` tokens, so the scored final token stays.

Load: each connection gets a handler thread (``ThreadingHTTPServer``, listen backlog 1024 so bursts
of clients queue instead of being reset). A handler checks ``Content-Length`` against
``--max_request_bytes`` *before* reading the body (413 otherwise), parses and validates the JSON (400
for anything malformed: invalid or non-UTF-8 JSON, nesting too deep, wrong types, more queries than
``--max_request_queries``), tokenizes the queries and queues them. Every error is a one-line
``{"error": ...}``. A client silent for ``--request_timeout`` seconds mid-body gets 408 (mid-headers:
the connection is closed); a client that hangs up early is logged at debug level only.

Batching: one worker thread scores micro-batches of at most ``--batch_size`` queries drawn from all
waiting requests at once, round-robin (each request contributes an equal share; a request's queries
go shortest first, so a micro-batch pads little; with ``--packing_samples`` a micro-batch is one packed
row, no padding, each query attending only to itself). Concurrent requests share forward passes, and a
large request is interleaved with the others instead of holding the model: a small request that
arrives while a large one is being scored is answered after about one micro-batch.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from tidal.config.args import ConfigError, deferred_checks
from tidal.config.model import ModelConfig
from tidal.config.serve_rm import RequestLimits, ServeRMConfig
from tidal.data.collate import collate_packed, collate_padded
from tidal.data.sft import SFTSample
from tidal.logging import get_logger
from tidal.models import Precision, load_tokenizer
from tidal.models.value_model import load_value_model

log = get_logger(__name__)

LISTEN_BACKLOG = 1024  # socketserver's default of 5 reset connections under a burst of 32 clients
DRAIN_LIMIT_BYTES = 256 * 1024 * 1024  # an oversized body up to this is read and dropped (see _refuse_body)


class RewardScorer:
    """Scores query texts with a reward model in padded batches of at most ``batch_size``."""

    def __init__(
        self,
        model,
        tokenizer,
        device: torch.device,
        precision: Precision,
        max_len: int,
        batch_size: int,
        packing: bool = False,
    ):
        self.model, self.tokenizer, self.device = model.eval(), tokenizer, device
        self.precision, self.max_len, self.batch_size = precision, max_len, batch_size
        self.collate = collate_packed if packing else collate_padded  # --packing_samples
        plain = tokenizer("a", add_special_tokens=True)["input_ids"]
        self.bos_id = (
            plain[0] if tokenizer.bos_token_id is not None and plain[0] == tokenizer.bos_token_id else None
        )

    @classmethod
    def load(cls, cfg: ServeRMConfig, device: torch.device) -> RewardScorer:
        # ModelConfig's rule that --load_in_4bit needs --lora_rank is about training (QLoRA); a served
        # model is only read, so that check is skipped here.
        with deferred_checks():
            model_cfg = ModelConfig(
                pretrain=cfg.reward_pretrain,
                param_dtype=cfg.param_dtype,
                attn_implementation=cfg.attn_implementation,
                load_in_4bit=cfg.load_in_4bit,
                disable_fast_tokenizer=cfg.disable_fast_tokenizer,
            )
        try:
            tokenizer = load_tokenizer(cfg.reward_pretrain, model_cfg)
            model = load_value_model(
                model_cfg,
                device,
                cfg.value_head_prefix,
                normalize_reward=cfg.normalize_reward,
                trained_head=True,
            )
        except ConfigError as err:  # the loaders name --pretrain; this command's flag is --reward_pretrain
            raise ConfigError(f"--reward_pretrain: {err}") from err
        precision = Precision.create(cfg.param_dtype, device)
        if not cfg.load_in_4bit:  # a 4-bit model keeps its quantized weights (bitsandbytes refuses .to)
            model = model.to(precision.dtype)
        return cls(model, tokenizer, device, precision, cfg.max_len, cfg.batch_size, cfg.packing_samples)

    def encode(self, text: str) -> list[int]:
        """Token ids of one query, tokenized as reward-model training data (see the module doc)."""
        tok = self.tokenizer
        ends = tuple(t for t in {tok.pad_token, tok.eos_token} if t)
        text = text.rstrip()
        while ends and text.endswith(ends):
            text = next(text[: -len(e)] for e in ends if text.endswith(e)).rstrip()
        ids = tok(text + tok.eos_token, add_special_tokens=False)["input_ids"]
        if self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids[-self.max_len :]

    def __call__(self, queries: Sequence[str]) -> list[float]:
        return self.score_encoded([self.encode(q) for q in queries])

    @torch.no_grad()
    def score_encoded(self, encoded: Sequence[list[int]]) -> list[float]:
        """Rewards of already tokenized queries (``encode``), in their order."""
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))  # similar lengths pad less
        rewards = [0.0] * len(encoded)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            batch = self.collate(
                [SFTSample(encoded[i], [0] * len(encoded[i])) for i in chunk], self.tokenizer.pad_token_id
            )
            batch = {k: v.to(self.device) for k, v in batch.items()}
            with self.precision.autocast():
                scores = self.model.scores(batch).float().tolist()
            for i, score in zip(chunk, scores, strict=True):
                rewards[i] = score
        return rewards


class RequestError(Exception):
    """A malformed request: answered with ``status`` and a JSON error message."""

    def __init__(self, status: HTTPStatus, message: str):
        super().__init__(message)
        self.status = status


def body_length(header: str | None, limits: RequestLimits) -> int:
    """The body size announced by a ``Content-Length`` header, checked before the body is read."""
    if header is None:
        raise RequestError(HTTPStatus.LENGTH_REQUIRED, "a Content-Length header is required")
    if not header.strip().isdigit():
        raise RequestError(HTTPStatus.BAD_REQUEST, f"Content-Length must be a byte count, got {header!r}")
    length = int(header)
    if length > limits.max_bytes:
        raise RequestError(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"request body of {length} bytes is over the server's --max_request_bytes {limits.max_bytes}; "
            "send fewer queries per request",
        )
    return length


def parse_request(body: bytes, limits: RequestLimits = RequestLimits()) -> list[str]:
    """The queries of a ``/get_reward`` body, after checking its shape (``RequestError`` if bad)."""
    try:
        data = json.loads(body)
    except RecursionError as err:  # json raises this for very deep nesting such as [[[[...]]]]
        raise RequestError(HTTPStatus.BAD_REQUEST, "body is not valid JSON: nested too deeply") from err
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, an integer with too many digits
        raise RequestError(HTTPStatus.BAD_REQUEST, f"body is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise RequestError(HTTPStatus.BAD_REQUEST, 'body must be a JSON object like {"query": [...]}')
    queries = data.get("query")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise RequestError(
            HTTPStatus.BAD_REQUEST, '"query" must be a list of strings (prompt + response texts)'
        )
    if len(queries) > limits.max_queries:
        raise RequestError(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"{len(queries)} queries in one request is over the server's --max_request_queries "
            f"{limits.max_queries}; send fewer queries per request",
        )
    for i, q in enumerate(queries):
        if not q.isascii():  # JSON's \ud800 escapes decode to lone surrogates, which no tokenizer takes
            try:
                q.encode("utf-8")
            except UnicodeEncodeError as err:
                raise RequestError(
                    HTTPStatus.BAD_REQUEST, f'"query"[{i}] is not valid Unicode text: {err.reason}'
                ) from err
    for key in ("prompts", "labels"):
        value = data.get(key)
        if value is not None and (not isinstance(value, list) or len(value) != len(queries)):
            raise RequestError(
                HTTPStatus.BAD_REQUEST, f'"{key}" must be a list with one entry per query ({len(queries)})'
            )
    return queries


def fair_shares(remaining: Sequence[int], budget: int) -> list[int]:
    """How many queries each waiting request puts into the next micro-batch of ``budget`` queries:
    one at a time round-robin in the given order, so small requests are taken whole and the largest
    split what is left (max-min fair)."""
    shares = [0] * len(remaining)
    open_ = [i for i, r in enumerate(remaining) if r > 0]
    while budget > 0 and open_:
        still_open = []
        for i in open_:
            if budget == 0:
                break
            shares[i] += 1
            budget -= 1
            if shares[i] < remaining[i]:
                still_open.append(i)
        open_ = still_open
    return shares


@dataclass
class _Job:
    """One request's queries as they pass through the worker (shortest first)."""

    items: list
    order: list[int] = field(init=False)
    taken: int = 0  # positions of ``order`` already put into micro-batches
    scored: int = 0
    rewards: list[float] = field(init=False)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.order = sorted(range(len(self.items)), key=lambda i: len(self.items[i]))
        self.rewards = [0.0] * len(self.items)

    @property
    def waiting(self) -> int:
        return len(self.items) - self.taken


class BatchingWorker:
    """One thread scoring micro-batches of at most ``batch_size`` queries drawn fairly from every
    waiting request (``fair_shares``); each request is answered as soon as all its queries are scored.

    ``score`` takes a list of queries (as ``submit`` got them) and returns one reward per query.
    """

    def __init__(self, score: Callable[[list], list[float]], batch_size: int):
        self.score, self.batch_size = score, batch_size
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self._closing, self._lock = False, threading.Lock()
        self.thread = threading.Thread(target=self._run, name="reward-worker", daemon=True)
        self.thread.start()

    def submit(self, items: list) -> list[float]:
        """Score ``items`` (blocks until done; re-raises the worker's error)."""
        if not items:
            return []
        job = _Job(list(items))
        with self._lock:  # nothing is queued behind the stop marker, so no request waits forever
            if self._closing:
                raise RuntimeError("the reward server is shutting down")
            self.jobs.put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.rewards

    def close(self) -> None:
        """Finish the requests already queued, then stop the thread."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self.jobs.put(None)
        self.thread.join(timeout=30)

    def _admit(self, active: deque[_Job], block: bool) -> bool:
        """Move newly queued requests to ``active``; False once the stop marker was seen."""
        while True:
            try:
                job = self.jobs.get(block=block)
            except queue.Empty:
                return True
            if job is None:
                return False
            active.append(job)
            block = False

    def _run(self) -> None:
        active: deque[_Job] = deque()
        running = True
        while running or active:
            if running:
                running = self._admit(active, block=not active)
            if not active:
                continue
            shares = fair_shares([job.waiting for job in active], self.batch_size)
            picks = [
                (job, job.order[job.taken + k])
                for job, n in zip(active, shares, strict=True)
                for k in range(n)
            ]
            for job, n in zip(active, shares, strict=True):
                job.taken += n
            # Requests left out of this micro-batch (more requests than batch_size) go first next time.
            served = [job for job, n in zip(active, shares, strict=True) if n]
            active = deque([job for job, n in zip(active, shares, strict=True) if not n] + served)
            self._score(picks)
            for job in served:
                if job.error is not None or job.scored == len(job.items):
                    active.remove(job)
                    job.done.set()

    def _score(self, picks: list[tuple[_Job, int]]) -> None:
        try:
            rewards = self.score([job.items[i] for job, i in picks])
            if len(rewards) != len(picks):
                raise RuntimeError(f"the scorer returned {len(rewards)} rewards for {len(picks)} queries")
        except Exception as err:  # reported to every request in this micro-batch; the worker keeps going
            log.exception("scoring failed")
            for job, _ in picks:
                job.error = err
            return
        for (job, i), reward in zip(picks, rewards, strict=True):
            job.rewards[i] = reward
            job.scored += 1


class _HTTPServer(ThreadingHTTPServer):
    request_queue_size = LISTEN_BACKLOG  # the kernel caps it at net.core.somaxconn
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up or stalled is the client's business (debug log, no traceback on
        stderr as socketserver prints by default); anything else is logged with its traceback."""
        err = sys.exc_info()[1]
        if isinstance(err, (ConnectionError, TimeoutError)):
            log.debug("client %s went away: %s", client_address, err)
        else:
            log.exception("request from %s failed", client_address)


class RewardServer:
    """The HTTP server around a ``BatchingWorker``; ``start()`` serves from a background thread.

    ``prepare`` turns one query text into what ``score`` takes (the real server tokenizes here, in
    the request's own thread, so the worker only runs forward passes).
    """

    def __init__(
        self,
        score: Callable[[list], list[float]],
        host: str,
        port: int,
        batch_size: int,
        limits: RequestLimits = RequestLimits(),
        prepare: Callable[[str], Any] | None = None,
    ):
        self.worker = BatchingWorker(score, batch_size)
        self.httpd = _HTTPServer((host, port), _handler_for(self.worker, limits, prepare or (lambda q: q)))
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> RewardServer:
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="reward-server", daemon=True)
        self.thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def close(self) -> None:
        if self.thread is not None:  # shutdown() waits for a serve_forever loop, so only when one runs
            self.httpd.shutdown()
        self.httpd.server_close()
        self.worker.close()

    def __enter__(self) -> RewardServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def one_line(text: str) -> str:
    """``text`` with its line breaks folded, so every error answer is a single line."""
    return " ".join(text.split())


class RewardHandler(BaseHTTPRequestHandler):
    """One HTTP request to the reward server: ``GET /health`` and ``POST /get_reward`` (the queries are
    ``prepare``d and scored by ``worker``), every answer JSON. ``_handler_for`` makes the subclass that a
    server uses, which sets the class attributes below."""

    worker: BatchingWorker
    limits: RequestLimits
    prepare: Callable[[str], Any]

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/health":
            self._reply(HTTPStatus.OK, {"status": "ok"})
        else:
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path}; use POST /get_reward"})

    def do_POST(self) -> None:
        announced = self.headers.get("Content-Length", "")
        self.unread = int(announced) if announced.strip().isdigit() else 0
        try:
            if self.path.rstrip("/") != "/get_reward":
                raise RequestError(HTTPStatus.NOT_FOUND, f"no such path {self.path}; use POST /get_reward")
            length = body_length(self.headers.get("Content-Length"), self.limits)
            body, self.unread = self._read_body(length), 0
            if len(body) < length:
                raise RequestError(HTTPStatus.BAD_REQUEST, f"body ended after {len(body)} of {length} bytes")
            queries = parse_request(body, self.limits)
            rewards = self.worker.submit([self.prepare(q) for q in queries])
        except RequestError as err:
            self._reply(err.status, {"error": str(err)})
            if err.status != HTTPStatus.REQUEST_TIMEOUT:  # a stalled client sends nothing more
                self._drop_unread_body()
        except Exception as err:  # a scoring failure is the server's, not the client's
            self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(err).__name__}: {err}"})
        else:
            self._reply(HTTPStatus.OK, {"rewards": rewards, "scores": rewards, "extra_logs": {}})

    def _read_body(self, length: int) -> bytes:
        try:
            return self.rfile.read(length)
        except TimeoutError as err:  # the socket's per-read timeout: the client stalled mid-body
            self.close_connection = True
            raise RequestError(
                HTTPStatus.REQUEST_TIMEOUT,
                f"the request body stalled: nothing arrived for {self.limits.read_timeout:g} s "
                "(--request_timeout)",
            ) from err

    def _drop_unread_body(self) -> None:
        """After an answer sent without reading the body (413, 404), read and drop up to
        ``DRAIN_LIMIT_BYTES`` of it before closing: closing a socket that still holds unread data
        resets the connection, and a client still sending would never see the answer."""
        self.close_connection = True
        try:
            while 0 < self.unread <= DRAIN_LIMIT_BYTES:
                chunk = self.rfile.read(min(self.unread, 1 << 16))
                if not chunk:
                    break
                self.unread -= len(chunk)
        except OSError:  # the client hung up or stalled: nothing left to protect
            pass

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # http.server's own errors (bad request line, unsupported method, headers too long) as JSON
        self.close_connection = True
        self._reply(HTTPStatus(code), {"error": message or HTTPStatus(code).phrase})

    def _reply(self, status: HTTPStatus, payload: dict) -> None:
        if "error" in payload:
            payload = {"error": one_line(payload["error"])}
        body = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (ConnectionError, TimeoutError) as err:  # the client hung up before its answer
            self.close_connection = True
            log.debug("%s went away before its answer: %s", self.address_string(), err)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s - %s", self.address_string(), format % args)


def _handler_for(
    worker: BatchingWorker, limits: RequestLimits, prepare: Callable[[str], Any]
) -> type[BaseHTTPRequestHandler]:
    """A ``RewardHandler`` bound to this server's worker, limits and query preparation."""
    timeout = limits.read_timeout  # per read: a client silent this long frees its thread
    attrs = {"worker": worker, "limits": limits, "prepare": staticmethod(prepare), "timeout": timeout}
    return type("Handler", (RewardHandler,), attrs)


def serve(cfg: ServeRMConfig, device: torch.device | None = None) -> RewardServer:
    """Load the reward model and bind the server (call ``serve_forever`` or ``start`` on it)."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    scorer = RewardScorer.load(cfg, device)
    server = RewardServer(scorer.score_encoded, cfg.host, cfg.port, cfg.batch_size, cfg.limits, scorer.encode)
    log.info("serving %s at %s/get_reward (batch size %d)", cfg.reward_pretrain, server.url, cfg.batch_size)
    return server
