"""``LLMEngine``: tidal's rollout engine (continuous batching over a paged KV cache).

Architecture (after nano-vllm, written for tidal):

- ``Scheduler`` (scheduler.py) keeps waiting and running ``Sequence``s and picks each step's batch:
  a prefill of newly admitted prompts, or one decode token for every running sequence. Finished
  sequences leave and waiting ones join at every step; when KV blocks run out the youngest running
  sequence is preempted and later recomputed.
- ``BlockManager`` (block_manager.py) owns the KV cache's block ids. The cache is paged: a pool of
  fixed-size blocks (``block_size`` token slots each, in one tensor
  ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``); each sequence has a block table.
  The ``n`` samples of a prompt are prefilled once and share the prompt's full blocks by reference count;
  each gets a private copy of the last partial block.
- ``ModelRunner`` (model_runner.py) builds flat token batches and attention metadata, runs the decoder
  (models/: shared layers, one file per family, the supported families in models/registry.py) and the
  on-device ``Sampler`` (sampler.py). On CUDA, decode steps replay CUDA graphs (cuda_graph.py) and
  decode attention is a Triton paged kernel (triton_attention.py); ``EngineConfig.enforce_eager`` turns
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
(``sleep`` / ``wake_up``) so a trainer can share the device between rollout and training.

``EngineConfig.tp_size`` N > 1 makes a tensor-parallel engine: this process is rank 0 (everything
above, unchanged API) and starts N-1 worker processes that each hold a shard of the model and of the
KV cache (``tp_worker.py``, ``models/parallel.py``); ``close()`` stops them.
"""

from __future__ import annotations

import random
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tidal.logging.console import get_logger
from tidal.logging.phases import Progress, on_main_process, phase, size_text
from tidal.rollout.batch_invariant import exact_device_problem
from tidal.rollout.models.loader import (
    build_decoder,
    context_prefill_problem,
    iter_checkpoint,
    tp_layout_problem,
)
from tidal.rollout.models.parallel import SINGLE
from tidal.rollout.models.registry import feature_refusal
from tidal.rollout.outputs import CompletionOutput, RequestOutput
from tidal.rollout.runner.model_runner import LaunchedStep, ModelRunner
from tidal.rollout.runner.multimodal import MultiModalInput, PromptImages, VisionSpec, prepare_images
from tidal.rollout.runner.sampler import sequence_seed
from tidal.rollout.sampling_params import SamplingParams
from tidal.rollout.scheduling.block_manager import BlockManager, blocks_needed
from tidal.rollout.scheduling.scheduler import Lookahead, ScheduledBatch, Scheduler
from tidal.rollout.scheduling.sequence import Sequence
from tidal.rollout.scheduling.state_cache import StateCache, StateSlots

log = get_logger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    """Engine capacity and placement. ``num_kv_blocks`` unset: sized from memory (see ``kv_blocks``)."""

    max_num_seqs: int = 256  # sequences decoded together
    max_num_batched_tokens: int = 16384  # prompt tokens per prefill step (a longer prompt runs alone)
    max_model_len: int | None = None  # prompt + output; default: the model's max_position_embeddings
    block_size: int = 16  # token slots per KV block
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.5  # CUDA: fraction of the free memory (after weights) for KV
    cpu_kv_cache_gb: float = 4.0  # CPU: KV cache budget
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda if available
    seed: int = 0  # seeds for requests without SamplingParams.seed
    enforce_eager: bool = False  # CUDA: run decode op by op instead of replaying CUDA graphs
    attention_backend: str = "auto"  # decode and context prefill: auto (triton on CUDA), triton, torch
    # Router replay: record each token's MoE experts into ``CompletionOutput.routed_experts`` (no CUDA graphs)
    record_routing: bool = False
    # Reuse the KV blocks of cached prompt prefixes (prefix_cache.py); vLLM's and OpenRLHF's name.
    enable_prefix_caching: bool = False
    # Prefill long prompts in chunks of at most max_num_batched_tokens, alternating with decode steps.
    enable_chunked_prefill: bool = False
    # Tensor parallelism: processes (devices) the engine spans; on CUDA the GPUs from ``device`` on.
    tp_size: int = 1
    # Sampled-token log-probs bit-identical to the trainer's exact-mode forward (tidal.rollout.batch_invariant);
    # float32 or bf16, CPU or CUDA (batch_invariant.exact_device_problem; the families: exact_problem).
    exact_logprobs: bool = False
    # Launch decode step t+1 while the device runs step t (module docstring); exact, so only speed changes.
    # Some settings keep the synchronous loop (``async_fallback``). None: on for CUDA, where the host's share
    # of a step can overlap the device's (0.5B, B=256: decode step 2.73 -> 1.86 ms, docs/benchmarks.md);
    # off on the CPU, where the host computes the step itself and there is nothing to overlap.
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.exact_logprobs and self.tp_size > 1:
            raise ValueError("EngineConfig: exact_logprobs needs tp_size 1")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.block_size < 1:
            raise ValueError("EngineConfig: max_num_seqs, max_num_batched_tokens and block_size must be >= 1")
        if self.tp_size < 1:
            raise ValueError(f"EngineConfig: tp_size must be >= 1, got {self.tp_size}")
        if (self.enable_prefix_caching or self.enable_chunked_prefill) and (
            self.record_routing or self.tp_size > 1
        ):
            raise ValueError(
                "EngineConfig: enable_prefix_caching and enable_chunked_prefill need tp_size 1 and "
                "record_routing (MoE router replay) off"
            )
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(
                f"EngineConfig: dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}"
            )
        if self.attention_backend not in ("auto", "triton", "torch"):
            raise ValueError(
                f"EngineConfig: attention_backend must be auto, triton or torch, got {self.attention_backend!r}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"EngineConfig: gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]


class LLMEngine:
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
        self.config = config or EngineConfig()
        self.progress_label: str | None = None  # set: ``generate`` logs its progress under this label
        self.hf_config = hf_config or _load_hf_config(model_path, model)
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(model_path)
        self.device = self.config.torch_device()
        self.dtype = self.config.torch_dtype(self.device)
        text_config = self.hf_config.get_text_config()  # a vision-language config's language model
        self.max_model_len = self.config.max_model_len or text_config.max_position_embeddings
        model_type = getattr(self.hf_config, "model_type", None)
        problem = self.config.exact_logprobs and exact_device_problem(self.device, self.dtype, model_type)
        if problem:
            raise ValueError(f"EngineConfig: {problem}")
        problem = family_problem(self.config, model_type)
        if problem:
            raise ValueError(f"EngineConfig: {problem}")
        # Features the family runs without (Family.refuses): eager decode steps, synchronous scheduling.
        self.eager = self.config.enforce_eager or feature_refusal(model_type, "cuda_graphs") is not None
        if model is not None:
            weights = _model_weights(model, model_type)
        elif state_dict is not None:
            weights = state_dict.items()
        elif model_path is not None:
            weights = iter_checkpoint(model_path)
        else:
            raise ValueError("LLMEngine needs a model folder path, a loaded model or a state_dict")
        self.peers = None
        try:
            self._build(weights, tp_group)
        except BaseException:
            self.close()
            raise
        self.eos_token_ids = _eos_token_ids(self.hf_config, model_path, model, self.tokenizer)
        # Vision families: the image placeholder and merge size, and the processor that makes pixels of
        # PIL images (from the model folder unless given).
        self.vision = VisionSpec.from_hf_config(self.hf_config) if hasattr(self.model, "visual") else None
        self.image_processor = image_processor
        if self.vision is not None and image_processor is None:
            self.image_processor = _load_image_processor(model_path)
        # Whether decode steps are launched ahead (the setting, unless ``async_fallback`` names a reason).
        wanted = self.config.async_scheduling
        if wanted is None:
            wanted = self.device.type == "cuda"
        refused = feature_refusal(model_type, "async_scheduling") is not None
        self.async_scheduling = wanted and not refused and async_fallback(self.config) is None
        self._ahead: _Ahead | None = None  # the decode step launched ahead, not yet scheduled for real
        self.ahead_stats = AheadStats()
        self.ahead_policy = AheadPolicy()
        # Linear-attention families: one recurrent-state slot per sequence slot (state_cache.py).
        states = StateSlots(self.config.max_num_seqs) if self.model.state_spec() is not None else None
        self.block_manager = BlockManager(
            self.num_kv_blocks,
            self.config.block_size,
            prefix_caching=self.config.enable_prefix_caching,
            state_slots=states,
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

    def _log_kv_cache(self) -> None:
        per_block = ModelRunner.bytes_per_block(self.model.args, self.config.block_size, self.dtype)
        tokens = self.num_kv_blocks * self.config.block_size
        kv = size_text(self.num_kv_blocks * per_block)
        if on_main_process():
            log.info("engine: KV cache of %d blocks, %d tokens, %s", self.num_kv_blocks, tokens, kv)

    def _kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = ModelRunner.bytes_per_block(self.model.args, cfg.block_size, self.dtype)
        # Never more than every sequence slot at full length could use.
        enough = cfg.max_num_seqs * blocks_needed(self.max_model_len, cfg.block_size)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * cfg.gpu_memory_utilization
        else:
            budget = cfg.cpu_kv_cache_gb * 2**30
        spec = self.model.state_spec()
        if spec is not None:  # the recurrent states of every sequence slot come out of the same budget
            budget -= (cfg.max_num_seqs + 1) * StateCache.bytes_per_slot(spec, self.dtype)
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

    def _snapshot(self, request_id: int) -> RequestOutput:
        group = self._requests[request_id]
        finished = all(seq.is_finished for seq in group)
        outputs = [
            self._completion(seq)
            if finished
            else CompletionOutput(
                seq.sample_index,
                "",
                seq.output_token_ids,
                list(seq.output_logprobs),
                None,
                top_logprobs=_copy(seq.output_top_logprobs),
            )
            for seq in group
        ]
        return RequestOutput(
            request_id, None, group[0].token_ids[: group[0].num_prompt_tokens], outputs, finished
        )

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

    def _launch_ahead(self, batch: ScheduledBatch, launched: LaunchedStep) -> _Ahead | None:
        plan = self.scheduler.plan_ahead(batch)
        if plan is None:
            return None
        try:
            step = self.runner.launch_ahead(plan.seqs, plan.rows, launched)
        finally:
            self.scheduler.release_ahead(plan)  # its inputs are staged; schedule() takes the blocks again
        self.ahead_stats.launched += 1
        return _Ahead(plan, step)

    def _drop_ahead(self) -> None:
        """Forget the step launched ahead (no sequence is left to use it, or the weights or cache change)."""
        if self._ahead is not None:
            self.runner.discard(self._ahead.launched)
            self._ahead = None

    def _params_per_prompt(self, num_prompts: int, sampling_params) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        if len(sampling_params) != num_prompts:
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {num_prompts} prompts")
        return list(sampling_params)

    def _encode(self, index: int, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"prompt {index} is a string but the engine has no tokenizer; pass token ids"
                )
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        vocab = self.model.args.vocab_size
        if not ids:
            raise ValueError(f"prompt {index} is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens but max_model_len is {self.max_model_len} "
                "(the prompt must leave room for at least one new token)"
            )
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt {index} has token ids outside [0, {vocab})")
        return ids

    def _encode_with_images(self, index: int, prompt, mm: MultiModalInput | None):
        """The prompt's ids (image placeholders expanded) and its ``PromptImages`` (None: text only)."""
        ids = self._encode(index, prompt)
        if mm is None or mm.num_images == 0:
            if self.vision is not None and self.vision.image_token_id in ids:
                raise ValueError(f"request {index}: the prompt has image placeholder tokens but no images")
            return ids, None
        if self.vision is None:
            raise ValueError(f"request {index} has images but the model has no vision tower")
        ids, images = prepare_images(index, ids, mm, self.vision, self.image_processor)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens with its image tokens but max_model_len is "
                f"{self.max_model_len} (the prompt must leave room for at least one new token)"
            )
        return ids, images

    def _make_group(
        self, index: int, ids: list[int], params: SamplingParams, mm: PromptImages | None = None
    ) -> list[Sequence]:
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"request {index}: n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"request {index}: stop strings need a tokenizer")
        bs = self.config.block_size
        longest = min(len(ids) + params.max_new_tokens, self.max_model_len)
        need = max(self.block_manager.group_blocks_needed(len(ids), params.n), blocks_needed(longest, bs))
        if need > self.num_kv_blocks:
            raise ValueError(
                f"request {index} needs {need} KV blocks (prompt {len(ids)} tokens, n={params.n}, "
                f"max_new_tokens={params.max_new_tokens}) but the cache has {self.num_kv_blocks}"
            )
        seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        group = []
        for sample in range(params.n):
            group.append(Sequence(self._next_seq_id, index, sample, ids, params, sequence_seed(seed, sample)))
            group[-1].mm = mm  # the n samples share the prompt's images (and its one prefill)
            self._next_seq_id += 1
        return group

    def _detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _completion(self, seq: Sequence) -> CompletionOutput:
        text = ""
        if self.tokenizer is not None:
            text = self._detokenize(seq.output_token_ids, seq.params.skip_special_tokens)
            text = _cut_at_stop(text, seq.params)
        return CompletionOutput(
            index=seq.sample_index,
            text=text,
            token_ids=seq.output_token_ids,
            logprobs=list(seq.output_logprobs),
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            routed_experts=None if seq.routing is None else np.stack(seq.routing[: seq.num_tokens - 1]),
            top_logprobs=_copy(seq.output_top_logprobs),
        )

    # ------------------------------------------------------------------ weights and memory
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping) -> int:
        """Load HF-named tensors in place (e.g. ``policy.named_parameters()``); return how many were loaded.

        Tied embeddings are handled (``lm_head.weight`` and ``model.embed_tokens.weight`` are one tensor);
        sharded DTensors are gathered with ``full_tensor()``.
        """
        if isinstance(named_tensors, Mapping):
            named_tensors = named_tensors.items()
        self._drop_ahead()  # it ran with the old weights
        self.block_manager.invalidate_prefix_cache()  # cached K/V was computed with the old weights
        count, nbytes, start = 0, 0, time.perf_counter()

        def gathered():
            nonlocal count, nbytes
            for name, tensor in named_tensors:
                count += 1
                nbytes += tensor.numel() * tensor.element_size()
                yield name, tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach()

        self.model.load_weights(gathered() if self.peers is None else self.peers.loading(gathered()))
        if on_main_process():
            log.info("engine: weights updated, %d tensors (%s as given) in %.1f s", count, size_text(nbytes),
                     time.perf_counter() - start)  # fmt: skip
        return count

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1); level 2 also moves the weights to CPU."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self._drop_ahead()
        self.block_manager.invalidate_prefix_cache()  # the cache's contents are freed
        with phase(f"engine: sleeping (level {level}: frees the {self._sleep_text(level)})"):
            if self.peers is not None:
                self.peers.sleep(level)
            self.runner.free_kv_cache()
            if level == 2 and self.device.type != "cpu":
                self.model.to("cpu")  # weights and the tables derived from them (RoPE buffers)
                torch.cuda.empty_cache()
        self.sleep_level = level

    def wake_up(self) -> None:
        """Restore what ``sleep`` freed; the KV cache comes back empty (no request survives a sleep)."""
        with phase(f"engine: waking up ({self._sleep_text(self.sleep_level)})"):
            if self.peers is not None:
                self.peers.wake()
            if self.sleep_level == 2 and self.device.type != "cpu":
                self.model.to(self.device)
            if self.runner.kv_cache is None:
                self.runner.allocate_kv_cache()
        self.sleep_level = 0

    def _sleep_text(self, level: int) -> str:
        """What a sleep of ``level`` frees: ``"KV cache, 4.4 GiB"`` (level 2 adds ``"; weights, 14.2 GiB"``)."""
        per_block = ModelRunner.bytes_per_block(self.model.args, self.config.block_size, self.dtype)
        text = f"KV cache, {size_text((self.num_kv_blocks + 1) * per_block)}"
        if level == 2:
            weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
            text += f"; weights, {size_text(weights)}"
        return text

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_level > 0


def _model_weights(model: torch.nn.Module, model_type: str | None):
    """A loaded transformers model's parameters, and the buffers its family's checkpoints carry as weights
    (``buffer_weights`` of the family class, e.g. Gemma 4's layer scalars)."""
    from itertools import chain

    from tidal.rollout.models.registry import FAMILIES, model_class

    suffixes = getattr(model_class(model_type), "buffer_weights", ()) if model_type in FAMILIES else ()
    buffers = ((name, b) for name, b in model.named_buffers() if suffixes and name.endswith(suffixes))
    return chain(model.named_parameters(), buffers)


def family_problem(config: EngineConfig, model_type: str | None) -> str | None:
    """The refusal (``Family.refuses``) of the first feature ``config`` asks for that the family of
    ``model_type`` does not support (None: it supports them all)."""
    asked = {
        "tensor_parallel": config.tp_size > 1,
        "prefix_caching": config.enable_prefix_caching,
        "chunked_prefill": config.enable_chunked_prefill,
        "record_routing": config.record_routing,
    }
    refusals = (feature_refusal(model_type, feature) for feature, on in asked.items() if on)
    return next((problem for problem in refusals if problem), None)


def async_fallback(config: EngineConfig) -> str | None:
    """Why an engine with these settings runs every step synchronously (None: async scheduling applies):
    router replay (routing is read back after each step) and prefix caching (taking a block evicts a
    cached one, which cannot be undone when a step launched ahead is discarded). Per step,
    ``Scheduler.plan_ahead`` names the steps that stay synchronous. Tensor-parallel engines launch ahead
    too: the other ranks receive the step's input ids from the driver's device (``ModelRunner``)."""
    if config.record_routing:
        return "record_routing"
    if config.enable_prefix_caching:
        return "enable_prefix_caching"
    return None


@dataclass
class AheadPolicy:
    """Whether to launch decode steps ahead. One that is used saves the host's share of a step (~1 ms);
    one that is discarded costs a device step (2.2 ms at 0.5B, 8 ms at 7B on an H200, docs/benchmarks.md),
    so launching pays while fewer than about host / device time of the steps are discarded (~0.5 at 0.5B,
    ~0.2 at 7B). Discards come from sequences stopping on a sampled token (eos, stop ids or strings: in RL,
    at many steps of a large batch), so their rate is tracked over recent decode steps, whether or not a
    step was launched ahead, and steps are launched while it is at most ``max_miss_rate``."""

    max_miss_rate: float = 0.2
    decay: float = 1 / 16  # weight of the latest step in the running rate (about the last 16 steps)
    miss_rate: float = 0.0

    @property
    def launch(self) -> bool:
        return self.miss_rate <= self.max_miss_rate

    def update(self, missed: bool) -> None:
        self.miss_rate += self.decay * (float(missed) - self.miss_rate)


@dataclass
class AheadStats:
    """Async scheduling's counts: decode steps launched ahead, and those used (the rest were discarded)."""

    launched: int = 0
    used: int = 0


@dataclass
class _Ahead:
    plan: Lookahead
    launched: LaunchedStep


def _copy(items: list | None) -> list | None:
    """A snapshot of a growing per-token list (None stays None)."""
    return None if items is None else list(items)


def _cut_at_stop(text: str, params: SamplingParams) -> str:
    hits = [(text.find(s), s) for s in params.stop if s in text]
    if not hits:
        return text
    index, stop = min(hits)
    return text[: index + len(stop)] if params.include_stop_str_in_output else text[:index]


def _load_hf_config(model_path, model):
    if model is not None:
        return model.config
    if model_path is None:
        raise ValueError("LLMEngine needs a model folder path, a loaded model or hf_config")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_path))


def _load_tokenizer(model_path):
    if model_path is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_path))
    except (OSError, ValueError):  # a weights-only folder: the engine still works on token ids
        return None


def _load_image_processor(model_path):
    """A vision model folder's image processor (None without one: requests then pass pixel_values)."""
    if model_path is None or not (Path(model_path) / "preprocessor_config.json").is_file():
        return None
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(model_path))


def _eos_token_ids(hf_config, model_path, model, tokenizer) -> set[int]:
    """Union of the config's, the generation config's and the tokenizer's eos ids (as vLLM does)."""
    ids: set[int] = set()
    sources = [getattr(hf_config, "eos_token_id", None)]
    gen_config = getattr(model, "generation_config", None)
    if (
        gen_config is None
        and model_path is not None
        and (Path(model_path) / "generation_config.json").exists()
    ):
        from transformers import GenerationConfig

        gen_config = GenerationConfig.from_pretrained(str(model_path))
    sources.append(getattr(gen_config, "eos_token_id", None))
    sources.append(getattr(tokenizer, "eos_token_id", None))
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(t) for t in source)
    return ids
