"""``EngineLoop``: one thread owns the ``LLMEngine``; HTTP handlers submit requests and get events.

The engine is not thread-safe, so only this thread touches it: it takes submissions and aborts from a
queue between steps, runs ``LLMEngine.step`` while any request is unfinished (requests from all
clients share the continuous batch) and blocks on the queue when idle. Each submission has a
listener, called on the engine thread with a ``RequestOutput`` snapshot (after every step that
advanced it when streaming, else only when finished) or with an exception if the engine failed it.
Listeners must be quick (hand the event to another thread's queue).

A failing step must not cost the other clients their requests. The engine drops every request when a
step raises, and the step cannot say which request caused it; so when it held more than one, the loop
*isolates*: it re-runs each of them alone, from the start, one after another (new submissions wait),
and only a request that fails alone gets the error. Requests are re-run with the seed they first ran
with (an unseeded one is given the seed the engine would have drawn), so a re-run samples the same
tokens and a stream continues where it was (the server sends only tokens beyond those already sent).
Validation (``tidal.serve.validation``) keeps every known bad value from reaching the engine; this is
the safety net for the unknown ones.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from tidal.logging import get_logger
from tidal.rollout import LLMEngine, RequestOutput, SamplingParams

log = get_logger(__name__)

Listener = Callable[[RequestOutput | BaseException], None]


class EngineStopped(RuntimeError):
    """The server shut down before the request finished."""


class _Submission:
    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        listener: Listener,
        stream: bool,
        multi_modal=None,
    ):
        self.prompt_ids, self.params, self.listener, self.stream = prompt_ids, params, listener, stream
        self.multi_modal = multi_modal  # the prompt's images (a MultiModalInput), None: text only
        self.accepted: Future[int] = Future()  # the loop's id for the request, or the ValueError refusing it
        self.loop_id: int | None = None  # stable across re-runs (the engine's id changes)
        self.engine_id: int | None = None


class EngineLoop:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # Engine thread only:
        self._active: dict[int, _Submission] = {}  # engine request id → submission in the engine
        self._accepted: dict[int, _Submission] = {}  # loop id → unfinished submission (active or suspect)
        self._suspects: deque[_Submission] = deque()  # dropped by a failed step: re-run alone, in turn
        self._held: deque[_Submission] = deque()  # submitted while isolating: admitted afterwards
        self._isolating = False
        self._ids = itertools.count()
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
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        listener: Listener,
        stream: bool,
        multi_modal=None,
    ) -> Future:
        """Queue a request (with its images, a ``MultiModalInput``, for a vision model); the returned
        future resolves to its id once the engine has accepted it (or raises the engine's
        ``ValueError``, e.g. too few KV blocks for it)."""
        submission = _Submission(prompt_ids, params, listener, stream, multi_modal)
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
            # Idle: block until a command; busy (or re-running suspects): take what is queued and step.
            busy = self.engine.has_unfinished() or self._isolating
            commands = [] if busy else [self._commands.get()]
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for kind, payload in commands:
                if kind == "stop":
                    self._fail_all(EngineStopped("the server is shutting down"))
                    return
                if kind == "add" and self._isolating:
                    self._held.append(payload)
                elif kind == "add":
                    self._add(payload)
                else:
                    self._abort(payload)
            if self._isolating and not self.engine.has_unfinished():
                self._next_suspect()
            if self.engine.has_unfinished():
                self._step()

    def _add(self, submission: _Submission) -> None:
        rng = getattr(
            self.engine, "_rng", None
        )  # the generator LLMEngine draws unseeded requests' seeds from
        if submission.params.seed is None and rng is not None:  # pin the seed it would draw, for a re-run
            submission.params = dataclasses.replace(submission.params, seed=rng.getrandbits(32))
        try:
            self._enter(submission)
        except Exception as err:  # ValueError: refused (e.g. too few KV blocks); anything else: a bug
            if not isinstance(err, ValueError):
                log.exception("the engine failed to take a request")
            submission.accepted.set_exception(err)
            return
        submission.loop_id = next(self._ids)
        self._accepted[submission.loop_id] = submission
        submission.accepted.set_result(submission.loop_id)

    def _enter(self, submission: _Submission) -> None:
        images = {} if submission.multi_modal is None else {"multi_modal": submission.multi_modal}
        submission.engine_id = self.engine.add_request(submission.prompt_ids, submission.params, **images)
        self._active[submission.engine_id] = submission

    def _abort(self, loop_id: int) -> None:
        submission = self._accepted.pop(loop_id, None)
        if submission is None:
            return
        if self._active.get(submission.engine_id) is submission:
            del self._active[submission.engine_id]
            self.engine.abort(submission.engine_id)
        elif submission in self._suspects:
            self._suspects.remove(submission)

    def _step(self) -> None:
        try:
            outputs = self.engine.step(snapshot=self._streams)
        except Exception as err:  # the engine dropped every request it held
            self._step_failed(err)
            return
        for out in outputs:
            submission = self._active.get(out.request_id)
            if submission is None:
                continue
            if out.finished:
                del self._active[out.request_id]
                self._accepted.pop(submission.loop_id, None)
            if out.finished or submission.stream:
                submission.listener(out)

    def _step_failed(self, err: Exception) -> None:
        victims = list(self._active.values())
        self._active.clear()
        for submission in victims:  # in case the engine kept any
            self.engine.abort(submission.engine_id)
        if len(victims) == 1:  # alone in the step: this request is the one that fails
            log.exception("engine step failed; its request is dropped")
            self._fail(victims[0], err)
            return
        log.exception("engine step failed with %d requests; re-running each alone", len(victims))
        self._suspects.extend(victims)
        self._isolating = True

    def _next_suspect(self) -> None:
        """Isolating, with the engine empty: run the next suspect alone, or, none left, admit the
        submissions that waited."""
        while self._suspects:
            submission = self._suspects.popleft()
            try:
                self._enter(submission)
                return
            except ValueError as err:  # it was accepted before; refused now only if the engine changed
                self._fail(submission, err)
        self._isolating = False
        while self._held:
            self._add(self._held.popleft())

    def _streams(self, request_id: int) -> bool:
        """Whether a request's listener wants every step's output (streaming); the others get the final
        one only, so the engine skips copying their outputs so far each step."""
        submission = self._active.get(request_id)
        return submission is not None and submission.stream

    def _fail(self, submission: _Submission, err: BaseException) -> None:
        self._accepted.pop(submission.loop_id, None)
        submission.listener(err)

    def _fail_all(self, err: BaseException) -> None:
        for engine_id in self._active:
            self.engine.abort(engine_id)
        self._active.clear()
        for submission in list(self._accepted.values()):
            self._fail(submission, err)
        self._suspects.clear()
        for submission in self._held:
            submission.accepted.set_exception(err)
        self._held.clear()
