"""The OpenAI-compatible HTTP server (``tidal serve``): Starlette routes over one ``EngineLoop``.

Routes: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/chat/completions``, ``POST
/v1/completions`` (streaming as server-sent events ``data: {...}`` ending with ``data: [DONE]``), and
``GET /health``; chat messages may carry images on a vision-language model (``images.py``). Handlers run on uvicorn's event loop; each reads its body within the limits
(``http.read_body``), validates it (``protocol``) on a worker thread (tokenizing a long prompt must not
stall the event loop: ``/health`` and the streams keep answering), submits one engine request per
prompt to the engine thread and awaits its events, so concurrent clients share the engine's continuous
batching. A client that disconnects, streaming or not, has its requests aborted (their KV blocks freed).
Every error is OpenAI's ``{"error": {"message", "type", "code", "param"}}``: 400 for a bad request
(malformed JSON, a bad field, a prompt beyond the context length), 404 for an unknown model or route,
408 for a client too slow to send its request, 413 for a body over ``--max_request_bytes``, 500 for a
request the engine failed (the others keep running: ``engine_loop``).

``OpenAIServer(engine, ...).start()`` serves on a background thread (tests, an RL trainer);
``serve_forever()`` serves on the calling thread until Ctrl-C (the CLI).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from tidal.config.serve import ServeLimits
from tidal.logging import get_logger
from tidal.rollout import LLMEngine, RequestOutput
from tidal.serve.engine_loop import EngineLoop, EngineStopped
from tidal.serve.http import ClientGone, client_gone, header_timeout_protocol, read_body
from tidal.serve.images import ChatImages, ImageLimits
from tidal.serve.protocol import (
    CHAT,
    ModelLimits,
    RequestError,
    ServeRequest,
    chunk_body,
    chunk_choice,
    decode_body,
    parse_chat,
    parse_completion,
    response_body,
    streamable_text,
    usage,
)
from tidal.serve.recorder import RequestRecorder

log = get_logger(__name__)

EPISODE_HEADER = "x-episode-id"


def _post(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, prompt_index: int, event) -> None:
    """Engine-thread listener: hand the event to the handler's loop (dropped if that loop is gone)."""
    with contextlib.suppress(RuntimeError):  # the event loop closed (shutting down): nobody is waiting
        loop.call_soon_threadsafe(events.put_nowait, (prompt_index, event))


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, allow_nan=False)}\n\n"  # log-probs are made finite before


# The HTTP request being served, for ``_serve`` (whose signature subclasses override) to watch its client.
_CLIENT: contextvars.ContextVar = contextvars.ContextVar("tidal_serve_client")


class _SampleStream:
    """What one streamed sample has sent so far (tokens, text)."""

    def __init__(self) -> None:
        self.tokens = 0
        self.text = ""

    def delta(
        self, tokenizer, req: ServeRequest, sample, finished: bool
    ) -> tuple[str, list, list, list | None]:
        """The text and tokens to send for this snapshot; nothing while the text is held back (its
        tokens go with the chunk that sends their text) or while a re-run (``engine_loop``) has not yet
        passed what was sent."""
        if len(sample.token_ids) <= self.tokens and not finished:
            return "", [], [], None
        if req.tool_parser is not None and not finished:
            return ("", *self._take(sample))  # tool calls: the text goes whole in the last chunk
        if finished:
            text = sample.text  # the engine's final text, cut at a stop string
        else:
            decoded = tokenizer.decode(sample.token_ids, skip_special_tokens=req.params.skip_special_tokens)
            text = streamable_text(decoded, req.params.stop)
        # Sent text cannot be taken back: send only what extends it (decoding a longer output keeps the
        # shorter one's text as a prefix once half-decoded characters and stop-string heads are held back).
        delta = text[len(self.text) :] if text.startswith(self.text) else ""
        if not delta and not finished:
            return "", [], [], None
        self.text += delta
        return (delta, *self._take(sample))

    def _take(self, sample) -> tuple[list, list, list | None]:
        """The tokens (ids, log-probs, alternatives) not sent yet, now counted as sent."""
        start, self.tokens = self.tokens, max(self.tokens, len(sample.token_ids))
        tops = None if sample.top_logprobs is None else sample.top_logprobs[start:]
        return sample.token_ids[start:], sample.logprobs[start:], tops


def _chat_images(engine: LLMEngine, limits: ServeLimits) -> ChatImages | None:
    """How chat requests' images are read: a vision family with an image processor (else None: a
    request with images is refused naming the model)."""
    vision, processor = getattr(engine, "vision", None), getattr(engine, "image_processor", None)
    if vision is None or processor is None:
        return None
    layout = getattr(engine, "image_layout", None)  # the family's processor layout (Gemma: begin/end)
    return ChatImages(
        processor,
        vision.merge_size,
        ImageLimits(limits.max_images, limits.max_image_pixels),
        None if layout is None else layout.image_markup,
    )


class OpenAIService:
    """The routes' logic over an ``EngineLoop``; ``app`` is the Starlette application."""

    def __init__(
        self,
        engine: LLMEngine,
        model_name: str,
        default_max_tokens: int | None = None,
        recorder: RequestRecorder | None = None,
        limits: ServeLimits | None = None,
    ):
        if engine.tokenizer is None:
            raise ValueError("tidal serve needs a model folder with a tokenizer")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.request_limits = limits or ServeLimits()
        self.limits = ModelLimits(
            model_name,
            engine.max_model_len,
            default_max_tokens,
            vocab_size=engine.model.args.vocab_size,
            max_samples=self.request_limits.max_request_samples,
        )
        self.images = _chat_images(engine, self.request_limits)
        self.recorder = recorder
        self.loop = EngineLoop(engine)
        # One thread parses requests and writes answers: tokenizing is CPU work that would stall the
        # event loop, and one thread keeps the tokenizer out of concurrent use.
        self._worker: ThreadPoolExecutor | None = None
        self.app = self._build_app()

    def _build_app(self):
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.routing import Route

        async def http_error(request, exc: HTTPException):
            code = "not_found" if exc.status_code == 404 else None
            return self._error(
                RequestError(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code, code)
            )

        routes = [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
        ]
        return Starlette(
            routes=routes,
            exception_handlers={HTTPException: http_error},
            lifespan=self._lifespan,
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="tidal-serve-parse")
        self.loop.start()
        try:
            yield
        finally:
            self.loop.close()
            self._worker.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, fn, *args):
        """``fn(*args)`` on the worker thread (the event loop keeps serving meanwhile)."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, partial(fn, *args))

    @staticmethod
    def _error(err: RequestError):
        from starlette.responses import JSONResponse

        headers = {"connection": "close"} if err.status == 408 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    # ------------------------------------------------------------------ routes
    async def health(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "ok"})

    def _model_card(self) -> dict:
        model = {"id": self.limits.name, "object": "model", "created": 0, "owned_by": "tidal"}
        model["max_model_len"] = self.limits.max_model_len
        quantization = (
            self.engine.config.quantization
        )  # --rollout_quantization (tidal's, beside vLLM's fields)
        if quantization != "none":
            model["quantization"] = quantization
        if self.engine.config.kv_cache_dtype != "auto":  # --kv_cache_dtype
            model["kv_cache_dtype"] = self.engine.config.kv_cache_dtype
        return model

    async def models(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request):
        from starlette.responses import JSONResponse

        name = request.path_params["model"]
        if name != self.limits.name:
            err = RequestError(f"The model '{name}' does not exist", 404, "model_not_found", "model")
            return self._error(err)
        return JSONResponse(self._model_card())

    async def chat(self, request):
        return await self._handle(request, CHAT)

    async def completions(self, request):
        return await self._handle(request, "completions")

    async def _handle(self, request, endpoint: str):
        limits = self.request_limits
        try:
            raw = await read_body(request, limits.max_request_bytes, limits.request_timeout)
            req = await self._off_loop(self._parse, raw, endpoint, request.headers.get(EPISODE_HEADER))
            _CLIENT.set(request)
            return await self._serve(req)
        except RequestError as err:
            return self._error(err)
        except ClientGone:  # nobody to answer; the engine has already dropped its requests
            log.debug("%s: the client disconnected before its answer", request.url.path)
            return self._error(RequestError("the client disconnected", 499))
        except Exception as err:  # a bug: still an OpenAI-style answer, and the server keeps serving
            log.exception("%s failed", request.url.path)
            return self._error(RequestError(f"internal error: {err}", 500, type="server_error"))

    def _parse(self, raw: bytes, endpoint: str, episode: str | None) -> ServeRequest:
        body = decode_body(raw)
        if endpoint == CHAT:
            return parse_chat(body, self.tokenizer, self.limits, episode, self.images)
        vocab = self.engine.model.args.vocab_size
        return parse_completion(body, self.tokenizer, self.limits, vocab, episode)

    async def _serve(self, req: ServeRequest):
        from starlette.responses import JSONResponse, StreamingResponse

        aio_loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        orders = [self.recorder.next_order() if self.recorder and req.episode_id else 0 for _ in req.prompts]
        images = req.multi_modal or [None] * len(req.prompts)
        accepted = [
            self.loop.submit(ids, req.params, partial(_post, aio_loop, events, i), req.stream, images[i])
            for i, ids in enumerate(req.prompts)
        ]
        ids = []
        try:
            for future in accepted:
                ids.append(await asyncio.wrap_future(future))
        except (ValueError, EngineStopped) as err:  # refused (e.g. the KV cache cannot hold it), or stopping
            for future in accepted:
                self._abort_when_accepted(future)
            if isinstance(err, EngineStopped):
                raise RequestError(str(err), 503, type="server_error") from err
            raise RequestError(str(err)) from err
        except asyncio.CancelledError:
            for future in accepted:
                self._abort_when_accepted(future)
            raise
        if req.stream:
            return StreamingResponse(self._stream(req, ids, events, orders), media_type="text/event-stream")
        outputs = await self._collect(ids, events)
        self._record(req, outputs, orders)
        body = await self._off_loop(response_body, req, self.limits.name, outputs, self.tokenizer)
        return JSONResponse(body)

    async def _collect(self, ids: list[int], events: asyncio.Queue) -> list[RequestOutput]:
        """The final outputs of a non-streaming request's engine requests; all of them are aborted if
        the client disconnects first (``ClientGone``) or one fails."""
        outputs: list[RequestOutput | None] = [None] * len(ids)
        request = _CLIENT.get(None)
        gone = asyncio.ensure_future(client_gone(request)) if request is not None else asyncio.Future()
        try:
            while any(o is None for o in outputs):
                event = asyncio.ensure_future(events.get())
                await asyncio.wait({event, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not event.done():
                    event.cancel()
                    raise ClientGone()
                i, result = event.result()
                if isinstance(result, BaseException):
                    raise RequestError(f"generation failed: {result}", 500, type="server_error")
                outputs[i] = result
        finally:
            gone.cancel()
            for i, out in enumerate(outputs):
                if out is None:
                    self.loop.abort(ids[i])
        return outputs

    def _abort_when_accepted(self, future) -> None:
        future.add_done_callback(lambda f: f.exception() is None and self.loop.abort(f.result()))

    def _record(self, req: ServeRequest, outputs: list[RequestOutput], orders: list[int]) -> None:
        if self.recorder is None or req.episode_id is None:
            return
        for out, order in zip(outputs, orders, strict=True):
            self.recorder.record(req.episode_id, order, req.endpoint, out)

    async def _stream(
        self, req: ServeRequest, ids: list[int], events: asyncio.Queue, orders
    ) -> AsyncIterator[str]:
        name, tok = self.limits.name, self.tokenizer
        streams = [[_SampleStream() for _ in range(req.n)] for _ in ids]
        finals: list[RequestOutput | None] = [None] * len(ids)
        try:
            if req.endpoint == CHAT:  # OpenAI opens each choice with the role
                first = [{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for k in range(len(ids) * req.n)]  # fmt: skip
                yield _sse(chunk_body(req, name, first))
            while any(f is None for f in finals):
                i, event = await events.get()
                if isinstance(event, BaseException):
                    err = RequestError(f"generation failed: {event}", 500, type="server_error")
                    yield _sse(err.body())
                    return
                choices = []
                for sample in event.outputs:
                    state = streams[i][sample.index]
                    offset = len(state.text)
                    text, new_ids, new_logprobs, new_tops = state.delta(tok, req, sample, event.finished)
                    if text or new_ids or event.finished:
                        index = i * req.n + sample.index
                        reason = sample.finish_reason if event.finished else None
                        choices.append(
                            chunk_choice(
                                req, tok, index, text, new_ids, new_logprobs, reason, offset, new_tops
                            )
                        )
                if choices:
                    yield _sse(chunk_body(req, name, choices))
                if event.finished:
                    finals[i] = event
            self._record(req, finals, orders)
            if req.include_usage:
                yield _sse(chunk_body(req, name, [], usage(finals)))
            yield "data: [DONE]\n\n"
        finally:  # a client that went away mid-stream: stop its samples
            for i, final in enumerate(finals):
                if final is None:
                    self.loop.abort(ids[i])


class OpenAIServer:
    """``OpenAIService`` under uvicorn: ``start()`` on a thread (``port`` 0 picks a free port) or
    ``serve_forever()`` on this one."""

    def __init__(
        self,
        engine: LLMEngine,
        model_name: str,
        host: str = "127.0.0.1",
        port: int = 0,
        default_max_tokens: int | None = None,
        recorder: RequestRecorder | None = None,
        log_level: str = "warning",
        limits: ServeLimits | None = None,
    ):
        import uvicorn

        limits = limits or ServeLimits()
        self.service = OpenAIService(engine, model_name, default_max_tokens, recorder, limits)
        config = uvicorn.Config(
            self.service.app,
            host=host,
            port=port,
            log_level=log_level,
            lifespan="on",
            http=header_timeout_protocol(limits.request_timeout),
        )
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._server.servers[0].sockets[0].getsockname()[1]

    @property
    def base_url(self) -> str:
        host = self._server.config.host
        return f"http://{host}:{self.port}/v1"

    def start(self) -> OpenAIServer:
        """Serve on a background thread; returns once the socket listens."""
        ready = threading.Event()
        server = self._server
        original = server.startup

        async def startup(sockets=None):
            await original(sockets)
            ready.set()

        server.startup = startup
        self._thread = threading.Thread(target=server.run, name="tidal-serve-http", daemon=True)
        self._thread.start()
        while not ready.wait(0.05):
            if not self._thread.is_alive():  # startup failed (port in use): uvicorn logged why
                raise OSError(f"tidal serve could not listen on {server.config.host}:{server.config.port}")
        if not server.started:
            raise OSError(f"tidal serve could not listen on {server.config.host}:{server.config.port}")
        return self

    def serve_forever(self) -> None:
        self._server.run()

    def close(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join()
        self.service.loop.close()

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
