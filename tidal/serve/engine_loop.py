"""``EngineLoop``: one thread owns the ``LLMEngine``; HTTP handlers submit requests and get events.

The engine is not thread-safe, so only this thread touches it: it takes submissions and aborts from a
queue between steps, runs ``LLMEngine.step`` while any request is unfinished (requests from all
clients share the continuous batch) and blocks on the queue when idle. Each submission has a
listener, called on the engine thread with a ``RequestOutput`` snapshot (after every step that
advanced it when streaming, else only when finished) or with an exception if the engine failed.
Listeners must be quick (hand the event to another thread's queue).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from tidal.logging import get_logger
from tidal.rollout import LLMEngine, RequestOutput, SamplingParams

log = get_logger(__name__)

Listener = Callable[[RequestOutput | BaseException], None]


class EngineStopped(RuntimeError):
    """The server shut down before the request finished."""


class _Submission:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, listener: Listener, stream: bool):
        self.prompt_ids, self.params, self.listener, self.stream = prompt_ids, params, listener, stream
        self.accepted: Future[int] = Future()  # the engine's request id, or the ValueError refusing it


class EngineLoop:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._active: dict[int, _Submission] = {}  # engine request id → submission (engine thread only)
        self._thread = threading.Thread(target=self._run, name="tidal-serve-engine", daemon=True)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread; unfinished requests get ``EngineStopped``."""
        if self._thread.is_alive():
            self._commands.put(("stop", None))
            self._thread.join()

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, listener: Listener, stream: bool
    ) -> Future:
        """Queue a request; the returned future resolves to its id once the engine has accepted it
        (or raises the engine's ``ValueError``, e.g. too few KV blocks for it)."""
        submission = _Submission(prompt_ids, params, listener, stream)
        if not self._thread.is_alive():
            submission.accepted.set_exception(EngineStopped("the server is shutting down"))
        else:
            self._commands.put(("add", submission))
        return submission.accepted

    def abort(self, request_id: int) -> None:
        """Drop an accepted request (its client went away); no further events come for it."""
        self._commands.put(("abort", request_id))

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        while True:
            # Idle: block until a command; busy: take what is queued and step.
            commands = [] if self.engine.has_unfinished() else [self._commands.get()]
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for kind, payload in commands:
                if kind == "stop":
                    self._fail_all(EngineStopped("the server is shutting down"))
                    return
                if kind == "add":
                    self._add(payload)
                elif self.engine.abort(payload):
                    self._active.pop(payload, None)
            if self.engine.has_unfinished():
                self._step()

    def _add(self, submission: _Submission) -> None:
        try:
            request_id = self.engine.add_request(submission.prompt_ids, submission.params)
        except ValueError as err:
            submission.accepted.set_exception(err)
            return
        self._active[request_id] = submission
        submission.accepted.set_result(request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step(snapshot=self._streams)
        except Exception as err:  # the engine dropped every request; tell their clients, keep serving
            log.exception("engine step failed; %d request(s) dropped", len(self._active))
            self._fail_all(err)
            return
        for out in outputs:
            submission = self._active.get(out.request_id)
            if submission is None:
                continue
            if out.finished:
                del self._active[out.request_id]
            if out.finished or submission.stream:
                submission.listener(out)

    def _streams(self, request_id: int) -> bool:
        """Whether a request's listener wants every step's output (streaming); the others get the final
        one only, so the engine skips copying their outputs so far each step."""
        submission = self._active.get(request_id)
        return submission is not None and submission.stream

    def _fail_all(self, err: BaseException) -> None:
        for request_id, submission in list(self._active.items()):
            self.engine.abort(request_id)
            submission.listener(err)
        self._active.clear()
