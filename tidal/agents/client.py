"""``LLMClient``: an asyncio client over the synchronous ``LLMEngine`` that batches concurrent requests.

Agent code is written per sample (``await llm.generate(ids, params)``), but the engine is efficient
only on batches. Requests are queued; a dispatcher task first lets every runnable coroutine reach its
next ``generate`` (it yields to the event loop until the queue stops growing for ``settle_rounds``
consecutive rounds), then calls ``engine.generate`` once for the whole queue and resolves each
request's future with its ``CompletionOutput``.

The engine runs on the event loop's thread: it is not thread-safe, and on CPU a thread would gain
nothing. An environment awaiting real I/O simply misses the current batch and joins the next one.
"""

from __future__ import annotations

import asyncio

from tidal.rollout.outputs import CompletionOutput
from tidal.rollout.sampling_params import SamplingParams


class LLMClient:
    """``await client.generate(prompt_ids, params)`` -> one ``CompletionOutput``; batched underneath."""

    def __init__(self, engine, settle_rounds: int = 3):
        if settle_rounds < 1:
            raise ValueError(f"settle_rounds must be >= 1, got {settle_rounds}")
        self.engine = engine
        self.settle_rounds = settle_rounds
        self._queue: list[tuple[list[int], SamplingParams, asyncio.Future, object]] = []
        self._dispatcher: asyncio.Task | None = None
        self.batch_sizes: list[int] = []  # requests per engine call, for logging and tests

    @property
    def tokenizer(self):
        return getattr(self.engine, "tokenizer", None)

    async def generate(
        self, prompt_ids: list[int], sampling_params: SamplingParams, multi_modal=None
    ) -> CompletionOutput:
        """One sample for ``prompt_ids`` (``sampling_params.n`` must be 1); ``multi_modal``: the prompt's
        images (a ``MultiModalInput``, for a vision-language engine), None for text."""
        if sampling_params.n != 1:
            raise ValueError(
                f"LLMClient.generate returns one sample; got SamplingParams(n={sampling_params.n})"
            )
        future = asyncio.get_running_loop().create_future()
        self._queue.append(([int(t) for t in prompt_ids], sampling_params, future, multi_modal))
        if self._dispatcher is None or self._dispatcher.done():
            self._dispatcher = asyncio.ensure_future(self._dispatch())
        return await future

    async def _dispatch(self) -> None:
        while self._queue:
            await self._settle()
            batch, self._queue = self._queue, []
            batch = [item for item in batch if not item[2].cancelled()]
            if batch:
                self._run_batch(batch)

    async def _settle(self) -> None:
        """Yield until the queue has not grown for ``settle_rounds`` rounds of the event loop."""
        quiet, seen = 0, len(self._queue)
        while quiet < self.settle_rounds:
            await asyncio.sleep(0)
            quiet = quiet + 1 if len(self._queue) == seen else 0
            seen = len(self._queue)

    def _run_batch(self, batch: list[tuple[list[int], SamplingParams, asyncio.Future, object]]) -> None:
        images = [mm for *_, mm in batch]
        # text-only batches call generate as before (every engine takes those)
        with_images = {"multi_modal": images} if any(mm is not None for mm in images) else {}
        try:
            outputs = self.engine.generate(
                [item[0] for item in batch], [item[1] for item in batch], **with_images
            )
        except Exception as err:  # every waiting sample sees the engine's error
            for _, _, future, _ in batch:
                if not future.done():
                    future.set_exception(err)
            return
        self.batch_sizes.append(len(batch))
        for (_, _, future, _), output in zip(batch, outputs, strict=True):
            if not future.done():
                future.set_result(output.outputs[0])

    @property
    def num_engine_calls(self) -> int:
        return len(self.batch_sizes)
