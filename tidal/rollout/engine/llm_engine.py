"""``LLMEngine``: tidal's rollout engine (continuous batching over a paged KV cache).

Architecture (after nano-vllm, written for tidal):

- ``Scheduler`` (scheduling/scheduler.py) keeps waiting and running ``Sequence``s and picks each step's batch:
  a prefill of newly admitted prompts, or one decode token for every running sequence. Finished
  sequences leave and waiting ones join at every step; when KV blocks run out the youngest running
  sequence is preempted and later recomputed.
- ``BlockManager`` (scheduling/block_manager.py) owns the KV cache's block ids. The cache is paged: a pool of
  fixed-size blocks (``block_size`` token slots each, in one tensor
  ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``); each sequence has a block table.
  The ``n`` samples of a prompt are prefilled once and share the prompt's full blocks by reference count;
  each gets a private copy of the last partial block.
- ``ModelRunner`` (runner/model_runner.py) builds flat token batches and attention metadata, runs the decoder
  (models/: shared layers, one file per family, the supported families in models/registry.py) and the
  on-device ``Sampler`` (runner/sampler.py). On CUDA, decode steps replay CUDA graphs (runner/cuda_graph.py) and
  decode attention is a Triton paged kernel (kernels/triton_attention.py); ``EngineConfig.enforce_eager`` turns
  the graphs off.

Two ways to drive it: ``generate`` runs a list of prompts to completion; the step-level API
(``add_request`` / ``step`` / ``has_unfinished`` / ``abort``) lets a caller that owns the engine (one
thread, e.g. ``tidal serve``'s engine loop) add and drop requests between steps, so requests that
arrive at different times share the continuous batch. The two are not mixed: ``generate`` refuses
while step-level requests are in flight.

Async scheduling (``EngineConfig.async_scheduling``): while the device runs decode step t, the host
launches step t+1 (inputs: step t's sampled ids, read on the device), then reads step t's ids and
post-processes them. Step t+1 was planned assuming no sequence stops at t; when the scheduler, run as in
the synchronous loop, then schedules a different step (a sequence stopped, a request came or went), the
early step is discarded and the scheduled one launched, so every step computes exactly what the
synchronous loop computes: same tokens and log-probs for a fixed seed. Which settings and steps stay
synchronous: ``async_fallback`` and ``Scheduler.plan_ahead``.

The engine also swaps weights in place (``update_weights``) and frees / restores its KV cache
(``sleep`` / ``wake_up``) so a trainer can share the device between rollout and training (``memory.py``).
The rest of this folder: ``config.py`` (``EngineConfig``), ``loading.py`` (config, tokenizer and weights of a
model folder), ``requests.py`` (prompts into sequences, sequences into outputs), ``ahead.py`` (async
scheduling's policy), ``hf_engine.py`` (``make_engine`` and the transformers fallback).

``EngineConfig.tp_size`` N > 1 makes a tensor-parallel engine: this process is rank 0 (everything
above, unchanged API) and starts N-1 worker processes that each hold a shard of the model and of the
KV cache (``runner/tp_worker.py``, ``models/parallel.py``); ``close()`` stops them.
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from tidal.logging.console import get_logger
from tidal.logging.phases import Progress, phase
from tidal.rollout.batch_invariant import exact_device_problem
from tidal.rollout.engine.ahead import Ahead, AheadPolicy, AheadStats, async_fallback
from tidal.rollout.engine.config import EngineConfig, family_problem
from tidal.rollout.engine.loading import (
    eos_token_ids,
    load_image_processor,
    load_tokenizer,
    model_weights,
    resolve_model,
)
from tidal.rollout.engine.memory import WeightsAndMemory
from tidal.rollout.engine.requests import RequestBuilding
from tidal.rollout.models.loader import (
    build_decoder,
    context_prefill_problem,
    iter_checkpoint,
    tp_layout_problem,
)
from tidal.rollout.models.parallel import SINGLE
from tidal.rollout.models.registry import feature_refusal
from tidal.rollout.outputs import RequestOutput
from tidal.rollout.runner.model_runner import ModelRunner
from tidal.rollout.runner.multimodal import MultiModalInput, VisionSpec, fixed_size_processor
from tidal.rollout.runner.steps import LaunchedStep
from tidal.rollout.sampling_params import SamplingParams
from tidal.rollout.scheduling.block_manager import BlockManager, blocks_needed
from tidal.rollout.scheduling.scheduler import ScheduledBatch, Scheduler
from tidal.rollout.scheduling.sequence import Sequence
from tidal.rollout.scheduling.state_cache import StateCache, StateSlots, saved_state_rows

log = get_logger(__name__)


class LLMEngine(RequestBuilding, WeightsAndMemory):
    """Generate from token ids (or strings) with a HF checkpoint of a supported decoder family.

    ``LLMEngine(path)`` reads config, tokenizer and safetensors from a HF folder. Alternatively pass
    ``model=`` (a loaded transformers model: its config and parameters are copied) or ``state_dict=``
    (HF names) together with ``path`` or ``hf_config``.

    A vision family (``registry.VISION_FAMILIES``: Qwen2.5-VL) takes each request's images as a
    ``multimodal.MultiModalInput`` (``generate(..., multi_modal=)``, ``add_request(..., multi_modal=)``);
    PIL images go through the folder's image processor, or ``image_processor=``.
    """

    def __init__(
        self,
        model_path: str | Path | None = None,
        config: EngineConfig | None = None,
        *,
        model: torch.nn.Module | None = None,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        hf_config=None,
        tokenizer=None,
        tp_group: tuple | None = None,
        image_processor=None,
    ):
        self.config, self.hf_config, model_type, self.device, self.dtype = resolve_model(
            model_path, config, model, hf_config
        )
        self.progress_label: str | None = None  # set: ``generate`` logs its progress under this label
        # set: ``generate`` calls it with its sequence groups after every step (partial rollouts: a weight
        # update lands there, the running sequences keeping their KV cache; tidal.placement.partial)
        self.between_steps: Callable[[list[list[Sequence]]], None] | None = None
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_path)
        text_config = self.hf_config.get_text_config()  # a vision-language config's language model
        self.max_model_len = self.config.max_model_len or text_config.max_position_embeddings
        problem = self.config.exact_logprobs and exact_device_problem(self.device, self.dtype, model_type)
        if problem:
            raise ValueError(f"EngineConfig: {problem}")
        problem = family_problem(self.config, model_type)
        if problem:
            raise ValueError(f"EngineConfig: {problem}")
        # Features the family runs without (Family.refuses): eager decode steps, synchronous scheduling.
        self.eager = self.config.enforce_eager or feature_refusal(model_type, "cuda_graphs") is not None
        if model is not None:
            weights = model_weights(model, model_type)
        elif state_dict is not None:
            weights = state_dict.items()
        elif model_path is not None:
            weights = iter_checkpoint(model_path)
        else:
            raise ValueError("LLMEngine needs a model folder path, a loaded model or a state_dict")
        # Whether decode steps are launched ahead (the setting, unless ``async_fallback`` names a reason;
        # known before the KV cache is sized: recurrent states are then double buffered, state_cache.py).
        wanted = self.config.async_scheduling
        if wanted is None:
            wanted = self.device.type == "cuda"
        refused = feature_refusal(model_type, "async_scheduling") is not None
        self.async_scheduling = wanted and not refused and async_fallback(self.config) is None
        self.peers = None
        try:
            self._build(weights, tp_group)
        except BaseException:
            self.close()
            raise
        self.eos_token_ids = eos_token_ids(self.hf_config, model_path, model, self.tokenizer)
        # Vision families: the image placeholder and merge size, and the processor that makes pixels of
        # PIL images (from the model folder unless given).
        self.vision = VisionSpec.from_hf_config(self.hf_config) if hasattr(self.model, "visual") else None
        self.image_processor = image_processor
        if self.vision is not None and image_processor is None:
            self.image_processor = load_image_processor(model_path)
        self.image_processor = fixed_size_processor(self.image_processor, self.hf_config)  # Gemma 3's
        self._ahead: Ahead | None = None  # the decode step launched ahead, not yet scheduled for real
        self.ahead_stats = AheadStats()
        self.ahead_policy = AheadPolicy()
        # Linear-attention families: one recurrent-state slot per sequence slot (state_cache.py).
        states = None
        if self.model.state_spec() is not None:
            states = StateSlots(self.config.max_num_seqs, double=self.async_scheduling)
        self.block_manager = BlockManager(
            self.num_kv_blocks,
            self.config.block_size,
            prefix_caching=self.config.enable_prefix_caching,
            state_slots=states,
            private_first_block=self.vision is not None,  # decode deltas are keyed by first block
            saved_states=self._saved_states(),
        )
        self._check_context_prefill()
        self.runner = ModelRunner(
            self.model,
            self.config.block_size,
            self.num_kv_blocks,
            self.eos_token_ids,
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.max_model_len,
            enforce_eager=self.eager,
            attention_backend=self.config.attention_backend,
            record_routing=self.config.record_routing,
            peers=self.peers,
            exact=self.config.exact_logprobs,
            lookahead=self.async_scheduling,
            saved_states=self._saved_states(),
            fp8_kv_cache=self.config.kv_cache_dtype == "fp8",
        )
        self.scheduler = Scheduler(
            self.block_manager,
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
            self.max_model_len,
            self.eos_token_ids,
            self._detokenize,
            chunked_prefill=self.config.enable_chunked_prefill,
        )
        self._rng = random.Random(self.config.seed)
        self._next_seq_id = 0
        self._next_request_id = 0
        self._requests: dict[int, list[Sequence]] = {}  # step-level requests in flight, by id
        self.sleep_level = 0

    # ------------------------------------------------------------------ setup
    def _build(self, weights, tp_group) -> None:
        """The model (this rank's shard) and the KV-cache size; with ``tp_size`` > 1, first the workers,
        which receive every weight as this process loads it and then the cache size. ``tp_group``
        (``tp_worker.colocated_group``): this process is one rank of an engine spanning training
        processes, which each load their shard themselves (``GroupPeers``)."""
        tp = SINGLE
        size = self.config.tp_size
        if tp_group is not None:
            from tidal.rollout.runner.tp_worker import GroupPeers

            self.peers = GroupPeers(*tp_group)
            tp = self.peers.tp
        elif size > 1:
            from tidal.rollout.runner.tp_worker import TPPeers, WorkerSpec, tp_devices

            problem = tp_layout_problem(self.hf_config, size)  # before any process starts
            if problem:
                raise ValueError(problem)
            spec = WorkerSpec(
                self.hf_config,
                self.max_model_len,
                self.dtype,
                self.config.block_size,
                self.config.max_num_seqs,
                self.eager,
                self.config.attention_backend,
                torch.get_num_threads(),
            )
            self.peers = TPPeers(spec, tp_devices(self.device, size))
            self._finalizer = weakref.finalize(self, self.peers.close)
            tp, weights = self.peers.tp, self.peers.broadcasting(weights)
        with phase(f"engine: loading weights ({self.dtype}) onto {self.device}"):
            self.model = build_decoder(
                self.hf_config, weights, self.max_model_len, self.dtype, self.device, tp
            )
        # FP8 rollouts: re-quantized at every load (tidal.rollout.quant)
        if self.config.quantization != "none":
            from tidal.rollout.quant import quantize_model

            with phase(f"engine: quantizing the linear layers to FP8 ({self.config.quantization})"):
                quantize_model(self.model, self.config.quantization)
        self.num_kv_blocks = self._kv_blocks()
        self._log_kv_cache()
        if tp_group is not None:
            self.num_kv_blocks = self.peers.agree_blocks(self.num_kv_blocks)
        elif self.peers is not None:
            self.peers.send("runner", self.num_kv_blocks)
            self.peers.wait_for("built", "building its shard and KV cache")

    def take_turns(self, generate):
        """Run ``generate()`` (calls of this engine's generation API): directly, or in an engine spanning
        training processes, in this rank's turn while serving the other ranks' turns."""
        return generate() if self.peers is None else self.peers.take_turns(generate, self.runner)

    def close(self) -> None:
        """Stop a tensor-parallel engine's worker processes (nothing to do for one process)."""
        if self.peers is not None:
            self.peers.close()

    def _check_context_prefill(self) -> None:
        """Prefix caching and chunked prefill compute a prompt's tail against its cached head: refuse, in
        one line, the models that cannot (``loader.context_prefill_problem``)."""
        cfg = self.config
        if not (cfg.enable_prefix_caching or cfg.enable_chunked_prefill):
            return
        wanted = "enable_prefix_caching" if cfg.enable_prefix_caching else "enable_chunked_prefill"
        reason = context_prefill_problem(self.hf_config)
        if reason:
            raise ValueError(f"{wanted} is not supported with {reason}")

    def _saved_states(self) -> int:
        """Rows of recurrent states saved at cached blocks' ends (linear-attention families, state_cache.py)."""
        if self.model.state_spec() is None:
            return 0
        return saved_state_rows(self.config.max_num_seqs, self.config.enable_prefix_caching)

    def _kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = self.kv_bytes_per_block()
        # Never more than every sequence slot at full length could use.
        enough = cfg.max_num_seqs * blocks_needed(self.max_model_len, cfg.block_size)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # what this process cached but does not use is free for the cache
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * cfg.gpu_memory_utilization
        else:
            budget = cfg.cpu_kv_cache_gb * 2**30
        spec = self.model.state_spec()
        if spec is not None:  # the recurrent states of every sequence slot come out of the same budget
            slots = cfg.max_num_seqs * (2 if self.async_scheduling else 1) + 1  # pairs: double buffering
            slots += self._saved_states()  # prefix caching: states saved at cached blocks' ends
            budget -= slots * StateCache.bytes_per_slot(spec, self.dtype)
        return max(1, min(enough, int(budget // per_block)))

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        multi_modal: list[MultiModalInput | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. ``multi_modal``: each
        prompt's images (``multimodal.MultiModalInput``, None for a text prompt), vision families only."""
        if self.sleep_level:
            raise RuntimeError("LLMEngine is asleep: call wake_up() before generate()")
        if self._requests:
            raise RuntimeError("LLMEngine.generate: step-level requests are in flight (add_request/step)")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = self._params_per_prompt(len(prompts), sampling_params)
        if multi_modal is not None and len(multi_modal) != len(prompts):
            raise ValueError(f"got {len(multi_modal)} multi_modal inputs for {len(prompts)} prompts")
        images = multi_modal or [None] * len(prompts)
        encoded = [
            self._encode_with_images(i, p, mm) for i, (p, mm) in enumerate(zip(prompts, images, strict=True))
        ]
        token_ids = [ids for ids, _ in encoded]
        groups = [
            self._make_group(i, ids, p, mm)
            for i, ((ids, mm), p) in enumerate(zip(encoded, params, strict=True))
        ]
        for group in groups:
            self.scheduler.add(group)
        self._run(groups, use_tqdm)
        return [
            RequestOutput(
                request_id=i,
                prompt=p if isinstance(p, str) else None,
                prompt_token_ids=ids,
                outputs=[self._completion(seq) for seq in group],
            )
            for i, (p, ids, group) in enumerate(zip(prompts, token_ids, groups, strict=True))
        ]

    # ------------------------------------------------------------------ step-level API
    def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        multi_modal: MultiModalInput | None = None,
    ) -> int:
        """Queue one prompt (text or token ids, with its images for a vision family) for the next
        ``step``; return its request id.

        Raises ``ValueError`` (and queues nothing) for a prompt that is empty, leaves no room for a new
        token, or needs more KV blocks than the cache has.
        """
        if self.sleep_level:
            raise RuntimeError("LLMEngine is asleep: call wake_up() before add_request()")
        request_id = self._next_request_id
        ids, mm = self._encode_with_images(request_id, prompt, multi_modal)
        group = self._make_group(request_id, ids, sampling_params or SamplingParams(), mm)
        self._next_request_id += 1
        self._requests[request_id] = group
        self.scheduler.add(group)
        return request_id

    def has_unfinished(self) -> bool:
        """Whether any step-level request still has a sample to generate."""
        return bool(self._requests)

    def step(self, snapshot: Callable[[int], bool] | None = None) -> list[RequestOutput]:
        """Run one scheduler step (a prefill or one decode token per running sample).

        Returns a snapshot of every request that sampled a token in this step: its samples' ids and
        log-probs so far, ``finished`` once all its samples have ended (then each sample's ``text`` and
        ``finish_reason`` are set; before that ``text`` is empty and ``finish_reason`` is ``None``).
        A finished request leaves the engine.

        ``snapshot(request_id)`` chooses the unfinished requests that get one (default: all); a finished
        request always does. A snapshot copies everything sampled so far, so a caller that needs only
        final outputs (a non-streaming server) skips a cost that grows with the length generated
        (measured: 1.3 ms of a 4.3 ms decode step at 256 requests, docs/benchmarks.md).
        """
        if not self._requests:
            return []
        try:
            batch, _ = self._advance()
        except BaseException:
            # Same rule as generate: a failed step must not leave half-advanced sequences behind.
            self.scheduler.abort_all()
            self._drop_ahead()
            self._requests.clear()
            raise
        advanced = dict.fromkeys(seq.request_index for seq in batch.seqs)
        outputs = []
        for request_id in advanced:
            finished = all(seq.is_finished for seq in self._requests[request_id])
            if finished or snapshot is None or snapshot(request_id):
                outputs.append(self._snapshot(request_id))
            if finished:
                del self._requests[request_id]
        if not self._requests:
            self._drop_ahead()
        return outputs

    def abort(self, request_id: int) -> bool:
        """Drop a step-level request (a client went away): its samples stop and free their KV blocks.

        Returns False when the request is unknown or already finished."""
        group = self._requests.pop(request_id, None)
        if group is None:
            return False
        scheduler = self.scheduler
        members = {seq.seq_id for seq in group}
        for seq in scheduler.running:
            if seq.seq_id in members:
                self.block_manager.free(seq)
        scheduler.running = type(scheduler.running)(s for s in scheduler.running if s.seq_id not in members)
        # Waiting groups are either never scheduled (no blocks) or preempted singles (blocks freed).
        waiting = [[s for s in g if s.seq_id not in members] for g in scheduler.waiting]
        scheduler.waiting = type(scheduler.waiting)(g for g in waiting if g)
        scheduler.drop_prefilling(members)  # chunked prefill: a group between chunks holds blocks
        return True

    def _run(self, groups: list[list[Sequence]], use_tqdm: bool) -> None:
        remaining = [len(g) for g in groups]
        # a caller's label (``progress_label``, the RL rollout's) logs requests done and tokens/s as they go
        progress = Progress(self.progress_label, len(groups), "requests") if self.progress_label else None
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(groups), desc="rollout", unit="req")
        try:
            while self.scheduler.has_unfinished():
                for seq in self._advance()[1]:
                    remaining[seq.request_index] -= 1
                    done = remaining[seq.request_index] == 0
                    if progress is not None:
                        progress.update(int(done), tokens=seq.num_output_tokens)
                    if bar is not None and done:
                        bar.update(1)
                if self.between_steps is not None:
                    self.between_steps(groups)
        except BaseException:
            # An interrupted call (error, Ctrl-C) must not leak its sequences into the next one.
            self.scheduler.abort_all()
            raise
        finally:
            self._drop_ahead()  # every sequence stopped at the last step: the one launched after is void
            if bar is not None:
                bar.close()
        if progress is not None:
            progress.close()

    def _advance(self) -> tuple[ScheduledBatch, list[Sequence]]:
        """One step of the synchronous loop (schedule, run, postprocess); returns it and the sequences
        that finished. With async scheduling the step may already be running (launched ahead by the call
        before, used when the scheduler schedules exactly it), and the next one is launched before this
        one's result is read."""
        batch = self.scheduler.schedule()
        if not self.async_scheduling:
            return batch, self.scheduler.postprocess(batch, *self.runner.run(batch))
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.plan.matches(batch):
            launched = ahead.launched
            self.ahead_stats.used += 1
        else:
            if ahead is not None:
                self.runner.discard(ahead.launched)
            launched = self.runner.launch(batch)
        self._ahead = self._launch_ahead(batch, launched) if self.ahead_policy.launch else None
        finished = self.scheduler.postprocess(batch, *launched.result())
        if not batch.is_prefill:  # a sequence stopping on its token changes the next step
            self.ahead_policy.update(any(seq.finish_reason == "stop" for seq in finished))
        return batch, finished

    def _launch_ahead(self, batch: ScheduledBatch, launched: LaunchedStep) -> Ahead | None:
        plan = self.scheduler.plan_ahead(batch)
        if plan is None:
            return None
        try:
            step = self.runner.launch_ahead(plan.seqs, plan.rows, launched)
        finally:
            self.scheduler.release_ahead(plan)  # its inputs are staged; schedule() takes the blocks again
        self.ahead_stats.launched += 1
        return Ahead(plan, step)

    def _drop_ahead(self) -> None:
        """Forget the step launched ahead (no sequence is left to use it, or the weights or cache change)."""
        if self._ahead is not None:
            self.runner.discard(self._ahead.launched)
            self._ahead = None
