"""``ModelRunner``: owns the decoder and the paged KV cache, turns a ``ScheduledBatch`` into tokens.

The KV cache is one tensor ``[layers, 2 (k, v), num_blocks + 1, block_size, kv_heads, head_dim]`` (a family
may declare another per-slot layout: ``kv_cache_layout``, e.g. MLA's one latent row) so that
a whole block can be copied for every layer at once (prompt sharing) and freed/re-allocated in one go
(``sleep``/``wake_up``). The extra last block is never handed out: CUDA-graph padding rows write there.

Decode, the hot path, keeps host work per step small and free of per-token Python: the inputs are three
int32 arrays (last token, context length, block table per sequence) written into one (pinned) staging
buffer and moved with one host-to-device copy; positions and KV slots are derived on device; on CUDA the
forward is a CUDA-graph replay (``cuda_graph.py``) unless ``enforce_eager``; the sampled tokens and
their log-probs come back with one device-to-host copy.

A step is *launched* (``launch``: everything enqueued, the copy to the host started, a ``LaunchedStep``
returned) and its result read later (``LaunchedStep.result``, the one wait on the device); ``run`` does
both at once. Async scheduling (the engine's ``async_scheduling``) launches the next decode step before
reading a step's result (``launch_ahead``): its input ids are the sampled ids still on the device, so
the host builds step t+1 while the device runs step t. Decode inputs then alternate between two staging
buffers, each rewritten only after the copy that last read it ran.

A tensor-parallel engine (``tp_worker.py``) runs one runner per rank, each with its shard of the model
and a KV cache of its KV heads only. Rank 0's runner turns each batch into a ``PrefillStep`` /
``DecodeStep`` (host arrays), sends it to the other ranks (``peers``), and all ranks run ``forward_step``
on it; the logits are gathered in the LM head, and rank 0 alone samples. On CUDA every rank replays its
own decode graphs, which capture the NCCL collectives too: the ranks capture a bucket at the same step
(the step says which bucket) and replay in the same order, as a collective needs. A decode step launched
ahead is sent without its input ids (they are on the driver's device only): every rank receives them by a
broadcast on the tensor group, and a receiving rank stages steps in two buffers in turn, as the driver does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import torch

from tidal.accel import triton_available
from tidal.rollout import batch_invariant as bi
from tidal.rollout.models.layers import ACTIVATIONS as ACTIVATIONS_BY_NAME
from tidal.rollout.models.layers import CausalLM, GatedMLP, RMSNorm, Rotary
from tidal.rollout.models.moe import SparseMoE
from tidal.rollout.models.parallel import ColumnParallelLinear, ParallelLMHead, RowParallelLinear
from tidal.rollout.runner.attention import AttentionMetadata
from tidal.rollout.runner.cuda_graph import DecodeGraphs, ahead_input_ids
from tidal.rollout.runner.sampler import Sampler, SamplingTensors, top_logprobs
from tidal.rollout.scheduling.scheduler import ScheduledBatch
from tidal.rollout.scheduling.sequence import Sequence
from tidal.rollout.scheduling.state_cache import StateCache

# What a step returns per sampled row: token ids, their log-probs and, when any row asks, each row's
# (token id, log-prob) alternatives (None for a row that did not ask); see ``ModelRunner.run``.
StepResult = tuple[list[int], list[float], list[list[tuple[int, float]] | None] | None]


@dataclass
class PrefillStep:
    """A prefill's model inputs as host arrays: one row per group (its first sequence's tokens)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    lens: list[int]
    rows: list[int]  # the logits row of each sampled sequence
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Linear-attention families: each group's state slot (its first sequence's), and the (src, dst) slots
    # the samples of a group copy their prompt's state between after the prefill.
    state_slots: list[int] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    # Vision families: the step's images and decode deltas (multimodal.PrefillImages); positions are then
    # [3, tokens] M-RoPE triples.
    images: object | None = None


@dataclass
class DecodeStep:
    """A decode step's staged int32 inputs (``fill_decode_inputs``) and its row counts."""

    staged: np.ndarray
    num_seqs: int
    rows: int
    width: int
    use_graph: bool
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    buffer: int = 0  # the staging buffer it is in
    state_slots: np.ndarray | None = None  # linear-attention families: each row's state slot (eager)
    # A step launched ahead (async scheduling): each row's input id is the previous step's sampled id at
    # the row staged in place of the token (``fill_decode_inputs``), read on the device.
    ahead: torch.Tensor | None = None
    # Tensor parallelism, set in the copy the other ranks receive (``for_peers``): how many sampled ids
    # ``ahead`` held (0: not launched ahead) and the rank that sampled them, which broadcasts them.
    ahead_rows: int = 0
    root: int = 0

    def for_peers(self, rank: int) -> DecodeStep:
        """The step as rank ``rank`` (the driver) sends it to the other ranks of a tensor-parallel engine:
        without ``ahead`` (the ids are on this rank's device only), with their count and this rank."""
        if self.ahead is None:
            return self
        return replace(self, ahead=None, ahead_rows=len(self.ahead), root=rank)


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are enqueued and whose copy to the host has started."""

    tokens: torch.Tensor | None  # [rows] sampled ids on the device (a step launched ahead reads them)
    host: torch.Tensor | None  # [rows, 2 + 2k] float64: token, log-prob, k alternative ids, k log-probs
    ready: torch.cuda.Event | None  # CUDA: recorded after the copy to the host
    top_rows: list[bool] | None = None  # k > 0: which rows asked for alternatives

    def result(self) -> StepResult:
        """Wait for the copy to the host; the step's tokens, log-probs and top alternatives."""
        if self.host is None:  # nothing sampled (every group of a chunked prefill is between chunks)
            return [], [], None
        if self.ready is not None:
            self.ready.synchronize()
        packed = self.host.numpy()
        tokens, logprobs = packed[:, 0].astype(np.int64).tolist(), packed[:, 1].tolist()
        if self.top_rows is None:
            return tokens, logprobs, None
        k = (packed.shape[1] - 2) // 2
        top_ids, top_values = packed[:, 2 : 2 + k].astype(np.int64).tolist(), packed[:, 2 + k :].tolist()
        top = [
            list(zip(row_ids, row_values, strict=True)) if asked else None
            for asked, row_ids, row_values in zip(self.top_rows, top_ids, top_values, strict=True)
        ]
        return tokens, logprobs, top


class StepPeers(Protocol):
    """The other ranks of a tensor-parallel engine, as rank 0's runner sees them."""

    def send_step(self, step: PrefillStep | DecodeStep) -> None: ...


class BlockTables:
    """The block tables of the last decode step staged, one int32 row per batch row, kept between steps so
    that a step rewrites only the rows whose table changed (a sequence got a block, or another sequence
    is in that row now) instead of converting every table from Python at every step.

    A row holds a reference to the list it was written from and that list's length then: a
    ``Sequence.block_table`` only grows in place (any other change assigns a new list, see ``Sequence``),
    so the same list at the same length has the same blocks."""

    def __init__(self, max_rows: int, max_blocks: int):
        self.array = np.zeros((max_rows, max_blocks), dtype=np.int32)  # unused entries: block 0
        self.held: list[list[int] | None] = [None] * max_rows  # the list each row was written from
        self.held_len = [0] * max_rows  # its length then
        self.lengths = np.zeros(max_rows, dtype=np.int64)  # held_len, to take the longest in one call

    def update(self, seqs: list[Sequence], rows: int) -> tuple[np.ndarray, int]:
        """``[rows, max_blocks]``: the tables of ``seqs``, then empty padding rows; and the longest one."""
        held, held_len = self.held, self.held_len
        for row, seq in enumerate(seqs):
            table = seq.block_table
            if held[row] is not table or held_len[row] != len(table):
                self._write(row, table)
        for row in range(len(seqs), rows):
            if held_len[row]:
                self._write(row, [])
        return self.array[:rows], int(self.lengths[:rows].max())

    def _write(self, row: int, table: list[int]) -> None:
        size, old = len(table), self.held_len[row]
        if self.held[row] is table and size == old + 1:  # the common change: one block appended
            self.array[row, old] = table[old]
        else:
            if size < old:
                self.array[row, size:old] = 0
            self.array[row, :size] = table
        self.held[row], self.held_len[row], self.lengths[row] = table, size, size


def fill_decode_inputs(
    seqs: list[Sequence],
    rows: int,
    width: int,
    out: np.ndarray,
    ahead: tuple[list[int], int] | None = None,
    tables: np.ndarray | None = None,
) -> np.ndarray:
    """Write ``[last tokens][context lengths][block tables rows x width]`` (int32) into ``out``.

    Rows past ``len(seqs)`` are padding (token 0, context 0); unused table entries are block 0, which
    the torch attention backend may gather but masks out. ``tables``: those rows x at least ``width``
    already (``BlockTables.update``), copied instead of written from the sequences' lists.

    ``ahead = (prev_rows, prev_size)``: a step launched ahead (async scheduling), whose last tokens are
    not on the host yet: the token field holds each sequence's row in the previous step's sampled ids
    (padding rows ``prev_size``, one past their end: token 0, see ``cuda_graph.ahead_input_ids``) and each
    context counts that token too.
    """
    n = len(seqs)
    view = out[: rows * (2 + width)]
    view[: 2 * rows] = 0
    if ahead is None:
        view[:n] = [seq.token_ids[-1] for seq in seqs]
        view[rows : rows + n] = [seq.num_tokens for seq in seqs]
    else:
        prev_rows, prev_size = ahead
        view[:rows] = prev_size
        view[:n] = prev_rows
        view[rows : rows + n] = [seq.num_tokens + 1 for seq in seqs]
    staged = view[2 * rows :].reshape(rows, width)
    if tables is not None:
        staged[:] = tables[:, :width]
        return view
    staged.fill(0)
    for row, seq in zip(staged, seqs, strict=False):
        row[: len(seq.block_table)] = seq.block_table
    return view


def kv_cache_layout(args) -> tuple[int, int, int]:
    """(tensors, heads, dim) the paged cache holds per layer and slot: k and v of each KV head this rank
    computes, unless the family's ``DecoderArgs`` declare a ``kv_cache_layout`` of their own (multi-head
    latent attention caches one latent row per token: ``models/mla.py``)."""
    layout = getattr(args, "kv_cache_layout", None)
    return layout if layout is not None else (2, args.local_kv_heads, args.head_dim)


def _state_copies(groups: list[list[Sequence]]) -> list[tuple[int, int]]:
    """(first sample's slot, other sample's slot) of every group with several samples."""
    return [(group[0].state_slot, seq.state_slot) for group in groups for seq in group[1:]]


def resolve_attention_backend(backend: str, device: torch.device, head_dim: int) -> str:
    """``auto``: the Triton paged kernel on CUDA when Triton is importable, else plain torch."""
    if backend != "auto":
        if backend == "triton" and device.type != "cuda":
            raise ValueError("attention_backend='triton' needs a CUDA device")
        return backend
    if device.type != "cuda" or head_dim & (head_dim - 1) or not triton_available():
        return "torch"
    return "triton"


def make_exact(model: CausalLM) -> None:
    """Switch the engine's decoder to the batch-invariant ops (``tidal.rollout.batch_invariant``), in place,
    computing what ``batch_invariant.make_exact`` makes a transformers model compute: a packed projection
    runs each of its parts (q, k, v; gate, up) as its own matmul, as the HF model's separate layers do."""
    problem = bi.exact_problem(model.args)
    if problem:
        raise ValueError(problem)
    act = ACTIVATIONS_BY_NAME[model.args.hidden_act]
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear):
            module.forward = bi.bound_forward(_exact_packed_linear, module)
        elif isinstance(module, (RowParallelLinear, ParallelLMHead)):
            module.forward = bi.bound_forward(lambda m, x: bi.linear(x, m.weight, m.bias), module)
        elif isinstance(module, RMSNorm):
            module.forward = bi.bound_forward(_exact_norm, module)
        elif isinstance(module, Rotary):
            module.forward = bi.bound_forward(_exact_rope, module)
        elif isinstance(module, GatedMLP):
            module.forward = bi.bound_forward(
                lambda m, x: m.down_proj(
                    bi.pointwise(act, _exact_part(m.gate_up_proj, x, 0)) * _exact_part(m.gate_up_proj, x, 1)
                ),
                module,
            )
        elif isinstance(module, SparseMoE):
            module.forward = bi.bound_forward(_exact_moe, module)


def _exact_rope(module: Rotary, positions: torch.Tensor, dtype: torch.dtype):
    """``rope_cos_sin`` from the RoPE frequencies (kept on the CPU by ``Rotary.build``) copied once to the
    positions' device: a decode step captured in a CUDA graph cannot copy from the host."""
    cached = getattr(module, "_exact_inv_freq", None)
    if cached is None or cached[0] is not module.inv_freq or cached[1].device != positions.device:
        cached = module._exact_inv_freq = (module.inv_freq, module.inv_freq.to(positions.device))
    return bi.rope_cos_sin(positions, cached[1], module.scale, dtype)


def _exact_packed_linear(module: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([_exact_part(module, x, i) for i in range(len(module.parts))], dim=-1)


def _exact_part(module: ColumnParallelLinear, x: torch.Tensor, part: int) -> torch.Tensor:
    """Packed part ``part``'s output: its rows of the weight (and bias) in a matmul of their own."""
    start = sum(p.size for p in module.parts[:part])
    size = module.parts[part].size
    bias = None if module.bias is None else module.bias[start : start + size]
    return bi.linear(x, module.weight[start : start + size], bias)


def _exact_norm(module: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None = None):
    if residual is None:
        return bi.rms_norm(x, module.weight, module.eps, module.scale_in_float32)
    total = x + residual
    return bi.rms_norm(total, module.weight, module.eps, module.scale_in_float32), total


def _exact_moe(module: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """``SparseMoE.forward`` through the ops the trainer's MoE blocks run in exact mode (``bi.moe_route``)."""
    moe, experts = module.moe, module.experts
    weights_dtype = None if moe.weights_in_model_dtype else torch.float32
    _, weights, ids = bi.moe_route(x, module.gate.weight, moe.top_k, moe.renormalize, weights_dtype)
    if module.recorded is not None:
        module.recorded.append(ids)
    out = bi.moe_experts(x, experts.gate_up_proj, experts.down_proj, ids, weights, experts.act)
    if moe.shared_expert_intermediate_size:
        gate_logit = bi.gate_column(x, module.shared_expert_gate.weight)
        out = bi.shared_expert_mix(out, gate_logit, module.shared_expert(x))
    return out


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        block_size: int,
        num_blocks: int,
        eos_token_ids: set[int],
        max_num_seqs: int = 256,
        max_model_len: int = 2048,
        enforce_eager: bool = False,
        attention_backend: str = "auto",
        record_routing: bool = False,
        peers: StepPeers | None = None,
        exact: bool = False,
        lookahead: bool = False,
    ):
        self.model = model
        # Exact log-probs (EngineConfig.exact_logprobs): the batch-invariant ops the trainer also runs.
        self.exact = exact
        if exact:
            make_exact(model)
        self.peers = peers
        # Router replay: the MoE blocks whose expert choices are recorded per token (none: dense model).
        self.routers = [m for m in model.modules() if isinstance(m, SparseMoE)] if record_routing else []
        self.args = model.args
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.pad_slot = num_blocks * block_size  # first slot of the reserved padding block
        self.eos_token_ids = sorted(eos_token_ids)
        self.device = model.model.embed_tokens.weight.device
        self.dtype = model.model.embed_tokens.weight.dtype
        self.backend = resolve_attention_backend(attention_backend, self.device, self.args.head_dim)
        self.sampler = Sampler(fused=self.device.type == "cuda", exact=exact)
        # The last step's sequences, their sampling tensors, and whether any row was under its
        # ``min_new_tokens`` then (``_sampling_tensors``).
        self._last_sampling: tuple[list[Sequence], SamplingTensors, bool] | None = None
        self.kv_cache: torch.Tensor | None = None
        # Linear-attention families: the per-sequence recurrent states, allocated and freed with the cache.
        spec = model.state_spec()
        self.states = None if spec is None else StateCache(spec, max_num_seqs, self.dtype, self.device)
        self.allocate_kv_cache()
        if hasattr(model, "reserve_block_state"):  # vision families: a decode delta per KV block
            model.reserve_block_state(num_blocks + 1)
        # Tokens no row may sample (their log-probs stay the model's): a vision family's image placeholders,
        # which the trainer's model would read as images in a response.
        self.never_sample = tuple(getattr(model, "never_sample", ()))
        max_blocks = -(-max_model_len // block_size)
        cuda = self.device.type == "cuda"
        # Staging buffers for a decode step's int32 inputs, pinned so the copy is asynchronous: one, or two
        # used in turn when steps are launched ahead (``lookahead``), each with an event recorded after the
        # copy that reads it, so that it is rewritten only once that copy ran.
        size = max_num_seqs * (2 + max_blocks)
        self._hosts = [torch.zeros(size, dtype=torch.int32, pin_memory=cuda) for _ in range(1 + lookahead)]
        self._hosts_np = [host.numpy() for host in self._hosts]
        self._tables = BlockTables(max_num_seqs, max_blocks)
        self._copied = [torch.cuda.Event() if cuda and lookahead else None for _ in self._hosts]
        self._next_host = 0
        self._discarded: LaunchedStep | None = None  # kept until a later step's result was read
        self.graphs = None
        # Recording runs decode eagerly (Python hooks), and so do exact MoE layers (``bi.moe_experts`` reads
        # each expert's row count on the host). Tensor-parallel ranks capture their collectives with the rest.
        exact_moe = exact and any(isinstance(m, SparseMoE) for m in model.modules())
        if cuda and not enforce_eager and not self.routers and not exact_moe:
            self.graphs = DecodeGraphs(self.decode_forward, self.device, max_num_seqs, max_blocks)

    @staticmethod
    def bytes_per_block(args, block_size: int, dtype: torch.dtype) -> int:
        """KV bytes of one block on one rank (a tensor-parallel rank caches its KV heads only)."""
        elem = torch.empty((), dtype=dtype).element_size()
        parts, heads, dim = kv_cache_layout(args)
        return args.kv_layers * parts * block_size * heads * dim * elem

    def allocate_kv_cache(self) -> None:
        a = self.args
        parts, heads, dim = kv_cache_layout(a)
        shape = (a.kv_layers, parts, self.num_blocks + 1, self.block_size, heads, dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.states is not None and self.states.conv is None:
            self.states.allocate()

    def free_kv_cache(self) -> None:
        if self.graphs is not None:  # they hold the cache's (and weights') addresses
            self.graphs.clear()
        self.kv_cache = None
        if self.states is not None:
            self.states.free()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _tensor(self, data, dtype=torch.int64) -> torch.Tensor:
        if self.device.type != "cuda":
            return torch.tensor(data, dtype=dtype, device=self.device)
        # From pinned memory without waiting: a copy from pageable memory waits for the device's queue,
        # which would stall the host behind a step launched ahead (async scheduling).
        # ``torch.tensor(..., pin_memory=True)`` refuses a numpy array: that one is copied into pinned memory.
        if isinstance(data, np.ndarray):
            host = torch.from_numpy(data).to(dtype).pin_memory()
        else:
            host = torch.tensor(data, dtype=dtype, pin_memory=True)
        return host.to(self.device, non_blocking=True)

    def run(self, batch: ScheduledBatch) -> StepResult:
        """Run one scheduled step: its sampled tokens, their log-probs and, for the rows whose request asks
        (``SamplingParams.logprobs``), their top alternatives (None when no row does)."""
        return self.launch(batch).result()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> LaunchedStep:
        """Enqueue one scheduled step (``run`` without the wait for its result)."""
        if batch.chunks is not None:
            return self._run_context_prefill(batch)
        for router in self.routers:
            router.recorded = []
        step = self._prefill_step(batch.groups) if batch.is_prefill else self._decode_step(batch.seqs)
        step.block_copies = batch.block_copies
        if self.peers is not None:
            self.peers.send_step(step)
        logits = self.forward_step(step)
        if self.routers:
            self._store_routing(batch)
        return self._sample(logits, batch.seqs)

    @torch.inference_mode()
    def launch_ahead(self, seqs: list[Sequence], prev_rows: list[int], prev: LaunchedStep) -> LaunchedStep:
        """Async scheduling: enqueue the decode step of ``seqs`` (``Scheduler.plan_ahead``, blocks taken)
        before ``prev``'s result is read: each sequence's input is the id sampled at row ``prev_rows[i]``
        of ``prev`` (on the device), its context and its sampling position one token further than the
        host knows. The inputs equal those ``launch`` builds once that token is appended."""
        step = self._decode_step(seqs, ahead=(prev_rows, prev.tokens))
        if self.peers is not None:  # the ids stay on the device: the other ranks get them by broadcast
            self.peers.send_step(step.for_peers(self.args.tp.rank))
        return self._sample(self.forward_step(step), seqs, ahead=1)

    def discard(self, launched: LaunchedStep) -> None:
        """Drop a step launched ahead that turned out not to be the next step (its results are never
        read); its sampling settings, advanced for it, are rebuilt by the next step."""
        self._last_sampling = None
        self._discarded = launched  # its copy to the host may be pending: keep the buffer alive

    def _store_routing(self, batch: ScheduledBatch) -> None:
        """Give each sequence the experts its step's input tokens were routed to (one copy to the host).

        A prefill reads every token of its group's first sequence (the samples share the prompt); a
        decode step reads each sequence's last token, at position ``num_tokens - 1``."""
        ids = torch.stack([r.recorded.pop() for r in self.routers], dim=1).to(torch.int16).cpu().numpy()
        for router in self.routers:
            router.recorded = None
        if batch.is_prefill:
            start = 0
            for group in batch.groups:
                n = group[0].num_tokens
                for seq in group:
                    seq.routing = list(ids[start : start + n])
                start += n
            return
        for row, seq in enumerate(batch.seqs):
            # in place (a list rebuilt every step would copy the whole record: quadratic in the length)
            routing = seq.routing if seq.routing is not None else []
            del routing[seq.num_tokens - 1 :]
            routing.append(ids[row])
            seq.routing = routing

    @torch.inference_mode()
    def forward_step(self, step: PrefillStep | DecodeStep) -> torch.Tensor:
        """The step's logits (one row per sampled sequence), then the KV block copies it asks for."""
        if isinstance(step, PrefillStep):
            input_ids, positions, meta, logits_index = self._prefill_tensors(step)
            extra = {} if step.images is None else {"images": step.images}
            logits = self.model(input_ids, positions, meta, logits_index, **extra)
            logits = logits[self._tensor(step.rows)]  # one prefill row per group -> one row per sample
            self._copy_states(step.state_copies)
        else:
            logits = self._decode_staged(step)
        if step.block_copies:
            src, dst = zip(*step.block_copies, strict=True)
            self.kv_cache[:, :, self._tensor(dst)] = self.kv_cache[:, :, self._tensor(src)]
        return logits

    def _prefill_step(self, groups: list[list[Sequence]]) -> PrefillStep:
        input_ids, positions, slots, lens = [], [], [], []
        bs = self.block_size
        for group in groups:
            seq = group[0]
            pos = np.arange(seq.num_tokens)
            input_ids.extend(seq.token_ids)
            positions.append(pos)
            slots.append(np.asarray(seq.block_table)[pos // bs] * bs + pos % bs)
            lens.append(seq.num_tokens)
        rows = [i for i, group in enumerate(groups) for _ in group]
        step = PrefillStep(
            np.asarray(input_ids), np.concatenate(positions), np.concatenate(slots), lens, rows
        )
        if self.states is not None:
            step.state_slots = [group[0].state_slot for group in groups]
            step.state_copies = _state_copies(groups)
        if hasattr(self.model, "reserve_block_state"):
            from tidal.rollout.runner.multimodal import prefill_images

            step.positions, step.images = prefill_images(groups)
        return step

    def _copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Give the samples of a prompt the state its prefill left in the first sample's slot."""
        if copies:
            src, dst = zip(*copies, strict=True)
            self.states.copy(self._tensor(src), self._tensor(dst))

    def _prefill_tensors(self, step: PrefillStep):
        lens = step.lens
        lens_t = self._tensor(lens)
        starts = torch.cumsum(lens_t, 0) - lens_t
        cols = torch.arange(max(lens), device=self.device)
        valid = cols[None, :] < lens_t[:, None]
        pad_index = torch.where(valid, starts[:, None] + cols[None, :], 0)
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=torch.from_numpy(step.slots).to(self.device),
            kv_cache=self.kv_cache,
            pad_index=pad_index,
            pad_valid=valid,
            unpad_index=valid.view(-1).nonzero().view(-1),
            exact=self.exact,
        )
        if self.states is not None:
            meta.states, meta.state_slots = self.states, self._tensor(step.state_slots)
        positions = torch.from_numpy(step.positions).to(self.device)
        return torch.from_numpy(step.input_ids).to(self.device), positions, meta, starts + lens_t - 1

    def _decode_step(
        self, seqs: list[Sequence], ahead: tuple[list[int], torch.Tensor] | None = None
    ) -> DecodeStep:
        """Stage one decode step's inputs in a host buffer (graph-bucketed rows when graphs apply);
        ``ahead``: a step launched ahead, (each sequence's row in, the sampled ids of) the step before."""
        n = len(seqs)
        use_graph = self.graphs is not None and n <= self.graphs.max_batch
        rows = self.graphs.bucket(n) if use_graph else n
        tables, width = self._tables.update(seqs, rows)
        buffer = self._next_host
        self._next_host = (buffer + 1) % len(self._hosts)
        if self._copied[buffer] is not None:
            self._copied[buffer].synchronize()  # the step staged there last has copied its inputs
        if ahead is None:
            staged = fill_decode_inputs(seqs, rows, width, self._hosts_np[buffer], None, tables)
            step = DecodeStep(staged, n, rows, width, use_graph, buffer=buffer)
            if self.states is not None:  # eager steps only (the family refuses CUDA graphs)
                step.state_slots = np.asarray([seq.state_slot for seq in seqs], dtype=np.int64)
            return step
        prev_rows, prev_tokens = ahead
        prev = (prev_rows, len(prev_tokens))
        staged = fill_decode_inputs(seqs, rows, width, self._hosts_np[buffer], prev, tables)
        return DecodeStep(staged, n, rows, width, use_graph, buffer=buffer, ahead=prev_tokens)

    def _decode_staged(self, step: DecodeStep) -> torch.Tensor:
        """Logits [num_seqs, vocab] of one decode step (graph replay when possible)."""
        rows, width, buffer = step.rows, step.width, step.buffer
        # A step received from another rank is in none of this rank's buffers.
        if buffer >= len(self._hosts) or not np.may_share_memory(step.staged, self._hosts_np[buffer]):
            buffer = self._receive(step.staged)
        host = self._hosts[buffer][: step.staged.size]
        copied = self._copied[buffer]
        ahead, root = step.ahead, self.args.tp.rank
        if step.ahead_rows:  # another rank sampled them (``DecodeStep.for_peers``)
            ahead, root = torch.empty(step.ahead_rows, dtype=torch.int64, device=self.device), step.root
        if ahead is not None and self.args.tp.size > 1:
            ahead = self.args.tp.broadcast(ahead.to(torch.int64), root=root)
        if step.use_graph:
            return self.graphs.run(host, step.num_seqs, rows, width, ahead, copied)
        stage = host.to(self.device, non_blocking=True)
        if copied is not None:
            copied.record()
        ids = stage[:rows] if ahead is None else ahead_input_ids(ahead, stage[:rows])
        state_slots = None if step.state_slots is None else self._tensor(step.state_slots)
        return self.decode_forward(
            ids, stage[rows : 2 * rows], stage[2 * rows :].view(rows, width), state_slots
        )

    def _receive(self, staged: np.ndarray) -> int:
        """Copy a step received from another rank into the next staging buffer; its index. The driver may
        send the next step before this rank's device has copied the last one in (a step launched ahead), so
        buffers are used in turn and one is rewritten only after the copy that last read it ran."""
        buffer = self._next_host
        self._next_host = (buffer + 1) % len(self._hosts)
        if self._copied[buffer] is not None:
            self._copied[buffer].synchronize()
        self._hosts_np[buffer][: staged.size] = staged
        return buffer

    def decode_forward(self, input_ids, context_lens, block_tables, state_slots=None) -> torch.Tensor:
        """One decode step from device tensors only (so it can be captured in a CUDA graph).

        Each row's query is its last token, at position ``context_len - 1``; a row with context length 0
        is padding: it reads nothing and stores its KV into the reserved padding slot.
        """
        bs = self.block_size
        positions = (context_lens - 1).clamp(min=0)
        block = block_tables.gather(1, (positions // bs).long()[:, None])[:, 0]
        slots = torch.where(context_lens > 0, block.long() * bs + positions % bs, self.pad_slot)
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=slots,
            kv_cache=self.kv_cache,
            block_tables=block_tables,
            context_lens=context_lens,
            backend=self.backend,
            exact=self.exact,
        )
        if self.states is not None:
            meta.states, meta.state_slots = self.states, state_slots
        return self.model(input_ids, positions, meta)

    def _run_context_prefill(self, batch: ScheduledBatch) -> LaunchedStep:
        """A prefill with context (prefix caching / chunked prefill): each group computes its tokens
        ``[start, end)`` against the K/V of ``[0, start)`` in the cache; only groups whose prompt ends
        here sample. Eager and single-process (the engine refuses these features with tensor parallelism
        and router replay)."""
        bs = self.block_size
        ids, positions, slots, tables = [], [], [], []
        for group, (start, end) in zip(batch.groups, batch.chunks, strict=True):
            seq = group[0]
            pos = np.arange(start, end)
            table = np.asarray(seq.block_table[: -(-end // bs)])
            ids.extend(seq.token_ids[start:end])
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            tables.append(table)
        width = max(len(t) for t in tables)
        padded = np.zeros((len(tables), width), dtype=np.int64)  # unused entries: block 0, masked out
        for row, table in zip(padded, tables, strict=True):
            row[: len(table)] = table
        lens_t = self._tensor([end - start for start, end in batch.chunks])
        starts = torch.cumsum(lens_t, 0) - lens_t
        cols = torch.arange(int(lens_t.max()), device=self.device)
        valid = cols[None, :] < lens_t[:, None]
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=self._tensor(np.concatenate(slots)),
            kv_cache=self.kv_cache,
            pad_index=torch.where(valid, starts[:, None] + cols[None, :], 0),
            pad_valid=valid,
            unpad_index=valid.view(-1).nonzero().view(-1),
            block_tables=self._tensor(padded),
            context_lens=self._tensor([end for _, end in batch.chunks]),
            query_starts=self._tensor([start for start, _ in batch.chunks]),
            backend=self.backend,
            exact=self.exact,
        )
        if self.states is not None:  # each group continues the state its earlier chunks left
            meta.states, meta.state_slots = self.states, self._tensor([g[0].state_slot for g in batch.groups])
        # Between chunks nothing samples; one row's logits anyway keeps every kernel's shapes non-empty.
        last = [i for i, final in enumerate(batch.final) if final] or [0]
        logits_index = (starts + lens_t - 1)[self._tensor(last)]
        logits = self.model(self._tensor(ids), self._tensor(np.concatenate(positions)), meta, logits_index)
        if batch.block_copies:  # n > 1: the samples' copies of the prompt's last block, now complete
            src, dst = zip(*batch.block_copies, strict=True)
            self.kv_cache[:, :, self._tensor(dst)] = self.kv_cache[:, :, self._tensor(src)]
        if self.states is not None:
            done = [group for group, final in zip(batch.groups, batch.final, strict=True) if final]
            self._copy_states(_state_copies(done))
        seqs = batch.seqs
        if not seqs:  # every group is between chunks: nothing to sample yet
            return LaunchedStep(None, None, None)
        sampled = [group for group, final in zip(batch.groups, batch.final, strict=True) if final]
        rows = self._tensor([i for i, group in enumerate(sampled) for _ in group])
        return self._sample(logits[rows], seqs)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], ahead: int = 0) -> LaunchedStep:
        """Sample one token per row (the top log-prob alternatives only when some row asks for them) and
        start the one device-to-host copy of the results (float64 holds every token id exactly)."""
        st = self._sampling_tensors(seqs, ahead)
        tokens, logprobs = self.sampler(logits, st)
        columns = [tokens.to(torch.float64), logprobs.to(torch.float64)]
        k = st.num_top_logprobs
        if k:
            ids, values = top_logprobs(logits, st, k, self.exact)
            columns = [c[:, None] for c in columns] + [ids.to(torch.float64), values.to(torch.float64)]
            packed = torch.cat(columns, dim=1)
        else:
            packed = torch.stack(columns, dim=1)
        top_rows = [seq.params.num_top_logprobs > 0 for seq in seqs] if k else None
        if not packed.is_cuda:
            return LaunchedStep(tokens, packed.cpu(), None, top_rows)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return LaunchedStep(tokens, host, ready, top_rows)

    def _sampling_tensors(self, seqs: list[Sequence], ahead: int = 0) -> SamplingTensors:
        """Per-row settings; a decode step over the same sequences as the previous one reuses its tensors
        with every position advanced by one (on device), instead of rebuilding them from Python.
        ``ahead``: tokens each sequence has sampled beyond what the host holds (a step launched ahead)."""
        cached = self._last_sampling
        if (
            cached is not None
            and cached[0] == seqs  # each of these sequences got exactly one token since (identity compare)
            and cached[1].suppress_rows is None
            and cached[1].penalty_rows is None  # the seen tokens change every step
            # A row's output count only grows while it stays in the batch: none that had reached its
            # ``min_new_tokens`` when the tensors were built can be under it now.
            and not (
                cached[2] and any(seq.num_output_tokens + ahead < seq.params.min_new_tokens for seq in seqs)
            )
        ):
            st = cached[1]
            if st.positions is not None:
                st.positions.add_(1)
            return st
        st = self._build_sampling_tensors(seqs, ahead)
        under_min = any(seq.num_output_tokens + ahead < seq.params.min_new_tokens for seq in seqs)
        self._last_sampling = (list(seqs), st, under_min)
        return st

    def _build_sampling_tensors(self, seqs: list[Sequence], ahead: int = 0) -> SamplingTensors:
        vocab = self.args.vocab_size
        params = [seq.params for seq in seqs]
        suppress = [
            (row, token)
            for row, seq in enumerate(seqs)
            if seq.num_output_tokens + ahead < seq.params.min_new_tokens
            for token in self._stop_ids(seq)
            if token < vocab
        ]
        suppress += [(row, token) for row in range(len(seqs)) for token in self.never_sample]
        suppress_rows = self._tensor([r for r, _ in suppress]) if suppress else None
        suppress_tokens = self._tensor([t for _, t in suppress]) if suppress else None
        penalty = self._penalty_tensors(seqs)
        top = min(max(p.num_top_logprobs for p in params), vocab)
        if all(p.greedy for p in params):
            return SamplingTensors(
                all_greedy=True,
                suppress_rows=suppress_rows,
                suppress_tokens=suppress_tokens,
                num_top_logprobs=top,
                **penalty,
            )
        # Two host-to-device copies for all per-row settings, not one per field.
        ints = self._tensor(
            [
                [p.top_k if p.top_k > 0 else vocab for p in params],
                [seq.noise_seed for seq in seqs],
                [seq.num_output_tokens + ahead for seq in seqs],
            ]
        )
        # One row per field, so each field is a contiguous [rows] view (the fused sampling kernel
        # reads row i at offset i; a column view of a [rows, 3] tensor gave it other fields' values).
        floats = self._tensor(
            [[p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params]],
            torch.float32,
        )
        return SamplingTensors(
            all_greedy=False,
            any_truncation=any(p.needs_truncation and not p.greedy for p in params),
            temperatures=floats[0],
            top_k=ints[0],
            top_p=floats[1],
            min_p=floats[2],
            seeds=ints[1],
            positions=ints[2],
            suppress_rows=suppress_rows,
            suppress_tokens=suppress_tokens,
            num_top_logprobs=top,
            **penalty,
        )

    def _penalty_tensors(self, seqs: list[Sequence]) -> dict:
        """``SamplingTensors``' repetition-penalty triples: each distinct token of the prompt and output
        of every row whose ``repetition_penalty`` is not 1 (none: the sampler's default path)."""
        rows, tokens, penalties = [], [], []
        for row, seq in enumerate(seqs):
            if seq.params.penalizes_repetition:
                seen = sorted(set(seq.token_ids))
                rows += [row] * len(seen)
                tokens += seen
                penalties += [seq.params.repetition_penalty] * len(seen)
        if not rows:
            return {}
        return {"penalty_rows": self._tensor(rows), "penalty_tokens": self._tensor(tokens),
                "penalties": self._tensor(penalties, torch.float32)}  # fmt: skip

    def _stop_ids(self, seq: Sequence) -> list[int]:
        eos = [] if seq.params.ignore_eos else self.eos_token_ids
        return sorted(set(eos) | set(seq.params.stop_token_ids))
