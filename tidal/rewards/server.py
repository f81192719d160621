"""HTTP reward server (``tidal serve_rm``) for ``--remote_rm_url http://host:port/get_reward``.

Protocol (DESIGN §3): ``POST /get_reward`` with JSON ``{"query": [str], "prompts": [str],
"labels": [...]}`` → ``{"rewards": [float], "scores": [float], "extra_logs": {}}``, one reward per
query, where a query is the full text (prompt + response). ``prompts`` and ``labels`` are optional;
when given they must be lists as long as ``query``; a reward model scores the query alone, so they
are only validated. ``scores`` equal the rewards (as OpenRLHF's server). ``GET /health`` answers
``{"status": "ok"}``. Malformed requests get a 4xx JSON ``{"error": ...}``; the server keeps serving.

Queries are tokenized like reward-model training data (``RewardScorer.encode``): trailing padding,
eos and whitespace are stripped and exactly one eos appended (as OpenRLHF), and a bos is prepended
when the tokenizer adds one to plain text and the text does not already start with it. A query
longer than ``--max_len`` tokens keeps its *last* ``max_len`` tokens, so the scored final token stays.

Batching: handler threads (``ThreadingHTTPServer``) put each request on a queue; one worker thread
takes the waiting requests, up to ``--batch_size`` queries, and scores them in one padded forward
(a single larger request is split into several), so concurrent requests share forward passes.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from tidal.config.args import ConfigError, arg
from tidal.config.model import ModelConfig
from tidal.data.collate import collate_padded
from tidal.data.sft import SFTSample
from tidal.logging import get_logger
from tidal.models import Precision, load_tokenizer
from tidal.models.value_model import load_value_model

log = get_logger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024


@dataclass
class ServeRMConfig:
    """Reward server: which reward model, where to listen, and how to batch."""

    reward_pretrain: str = arg(
        help="reward model folder (trained with tidal rm) to serve (required)", metavar="PATH"
    )
    host: str = arg("127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    port: int = arg(5000, help="port to listen on (0: any free port)")
    max_len: int = arg(2048, help="queries longer than this many tokens keep their last max_len tokens")
    batch_size: int = arg(16, help="most queries per forward pass; concurrent requests are coalesced")
    normalize_reward: bool = arg(False, help="return (reward - mean) / std with the stats stored by tidal rm")
    value_head_prefix: str = arg(
        "score", help="attribute name of the value head", aliases=["--value_prefix_head"]
    )
    param_dtype: str = arg(
        "auto",
        help="compute dtype (auto: bf16 on CUDA, fp32 on CPU)",
        choices=("auto", "bf16", "fp16", "fp32"),
    )
    attn_implementation: str = arg(
        "sdpa", help="attention kernel passed to transformers", choices=("sdpa", "eager", "flash_attention_2")
    )

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_len < 2:
            raise ConfigError("--batch_size must be >= 1 and --max_len >= 2")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")


class RewardScorer:
    """Scores query texts with a reward model in padded batches of at most ``batch_size``."""

    def __init__(
        self, model, tokenizer, device: torch.device, precision: Precision, max_len: int, batch_size: int
    ):
        self.model, self.tokenizer, self.device = model.eval(), tokenizer, device
        self.precision, self.max_len, self.batch_size = precision, max_len, batch_size
        plain = tokenizer("a", add_special_tokens=True)["input_ids"]
        self.bos_id = (
            plain[0] if tokenizer.bos_token_id is not None and plain[0] == tokenizer.bos_token_id else None
        )

    @classmethod
    def load(cls, cfg: ServeRMConfig, device: torch.device) -> RewardScorer:
        model_cfg = ModelConfig(
            pretrain=cfg.reward_pretrain,
            param_dtype=cfg.param_dtype,
            attn_implementation=cfg.attn_implementation,
        )
        try:
            tokenizer = load_tokenizer(cfg.reward_pretrain)
            model = load_value_model(
                model_cfg, device, cfg.value_head_prefix, normalize_reward=cfg.normalize_reward
            )
        except ConfigError as err:  # the loaders name --pretrain; this command's flag is --reward_pretrain
            raise ConfigError(f"--reward_pretrain: {err}") from err
        precision = Precision.create(cfg.param_dtype, device)
        return cls(model.to(precision.dtype), tokenizer, device, precision, cfg.max_len, cfg.batch_size)

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

    @torch.no_grad()
    def __call__(self, queries: Sequence[str]) -> list[float]:
        encoded = [self.encode(q) for q in queries]
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))  # similar lengths pad less
        rewards = [0.0] * len(encoded)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            batch = collate_padded(
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


def parse_request(body: bytes) -> list[str]:
    """The queries of a ``/get_reward`` body, after checking its shape (``RequestError`` if bad)."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RequestError(HTTPStatus.BAD_REQUEST, f"body is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise RequestError(HTTPStatus.BAD_REQUEST, 'body must be a JSON object like {"query": [...]}')
    queries = data.get("query")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise RequestError(
            HTTPStatus.BAD_REQUEST, '"query" must be a list of strings (prompt + response texts)'
        )
    for key in ("prompts", "labels"):
        value = data.get(key)
        if value is not None and (not isinstance(value, list) or len(value) != len(queries)):
            raise RequestError(
                HTTPStatus.BAD_REQUEST, f'"{key}" must be a list with one entry per query ({len(queries)})'
            )
    return queries


@dataclass
class _Job:
    queries: list[str]
    done: threading.Event = field(default_factory=threading.Event)
    rewards: list[float] | None = None
    error: BaseException | None = None


class BatchingWorker:
    """One thread scoring queued requests, coalescing waiting ones up to ``batch_size`` queries."""

    def __init__(self, score: Callable[[list[str]], list[float]], batch_size: int):
        self.score, self.batch_size = score, batch_size
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="reward-worker", daemon=True)
        self.thread.start()

    def submit(self, queries: list[str]) -> list[float]:
        """Score ``queries`` (blocks until done; re-raises the worker's error)."""
        if not queries:
            return []
        job = _Job(list(queries))
        self.jobs.put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.rewards

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def _take(self) -> list[_Job] | None:
        first = self.jobs.get()
        if first is None:
            return None
        jobs, size = [first], len(first.queries)
        while size < self.batch_size:
            try:
                nxt = self.jobs.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                self.jobs.put(None)  # stop after this batch
                break
            jobs.append(nxt)
            size += len(nxt.queries)
        return jobs

    def _run(self) -> None:
        while (jobs := self._take()) is not None:
            try:
                rewards = self.score([q for job in jobs for q in job.queries])
            except Exception as err:  # reported to every waiting request; the worker keeps going
                log.exception("scoring failed")
                for job in jobs:
                    job.error = err
            else:
                start = 0
                for job in jobs:
                    job.rewards = rewards[start : start + len(job.queries)]
                    start += len(job.queries)
            for job in jobs:
                job.done.set()


class RewardServer:
    """The HTTP server around a ``BatchingWorker``; ``start()`` serves from a background thread."""

    def __init__(self, score: Callable[[list[str]], list[float]], host: str, port: int, batch_size: int):
        self.worker = BatchingWorker(score, batch_size)
        self.httpd = ThreadingHTTPServer((host, port), _handler_for(self.worker))
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


def _handler_for(worker: BatchingWorker) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/health":
                self._reply(HTTPStatus.OK, {"status": "ok"})
            else:
                self._reply(
                    HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path}; use POST /get_reward"}
                )

        def do_POST(self) -> None:
            try:
                if self.path.rstrip("/") != "/get_reward":
                    raise RequestError(
                        HTTPStatus.NOT_FOUND, f"no such path {self.path}; use POST /get_reward"
                    )
                rewards = worker.submit(parse_request(self._body()))
            except RequestError as err:
                self._reply(err.status, {"error": str(err)})
            except Exception as err:  # a scoring failure is the server's, not the client's
                self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(err).__name__}: {err}"})
            else:
                self._reply(HTTPStatus.OK, {"rewards": rewards, "scores": rewards, "extra_logs": {}})

        def _body(self) -> bytes:
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                raise RequestError(HTTPStatus.LENGTH_REQUIRED, "a Content-Length header is required")
            if int(length) > MAX_BODY_BYTES:
                raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {MAX_BODY_BYTES} bytes")
            return self.rfile.read(int(length))

        def _reply(self, status: HTTPStatus, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s - %s", self.address_string(), format % args)

    return Handler


def serve(cfg: ServeRMConfig, device: torch.device | None = None) -> RewardServer:
    """Load the reward model and bind the server (call ``serve_forever`` or ``start`` on it)."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    scorer = RewardScorer.load(cfg, device)
    server = RewardServer(scorer, cfg.host, cfg.port, cfg.batch_size)
    log.info("serving %s at %s/get_reward (batch size %d)", cfg.reward_pretrain, server.url, cfg.batch_size)
    return server
