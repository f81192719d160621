"""``ModelRunner``: owns the decoder and the paged KV cache, turns a ``ScheduledBatch`` into tokens.

The KV cache is one tensor ``[layers, 2 (k, v), num_blocks + 1, block_size, kv_heads, head_dim]`` (a family
may declare another per-slot layout: ``kv_cache_layout``, e.g. MLA's one latent row) so that
a whole block can be copied for every layer at once (prompt sharing) and freed/re-allocated in one go
(``sleep``/``wake_up``). The extra last block is never handed out: CUDA-graph padding rows write there.
An FP8 cache (``kv_cache.py``) holds e4m3 rows, their scales in a second tensor beside it.

Decode, the hot path, keeps host work per step small and free of per-token Python: the inputs are three
int32 arrays (last token, context length, block table per sequence; a family with recurrent states adds
the state slots each row reads and writes, ``StateCache.decode_slots``) written into one (pinned) staging
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

Beside it: ``steps.py`` (the step records and decode block tables), ``sampling_inputs.py`` (each step's
``SamplingTensors``), ``exact_model.py`` (exact mode's batch-invariant decoder).
"""

from __future__ import annotations

import numpy as np
import torch

from tidal.accel import triton_available
from tidal.rollout.models.layers import CausalLM
from tidal.rollout.models.moe import SparseMoE
from tidal.rollout.runner import kv_cache
from tidal.rollout.runner.attention import AttentionMetadata
from tidal.rollout.runner.cuda_graph import DecodeGraphs, ahead_input_ids
from tidal.rollout.runner.exact_model import make_exact
from tidal.rollout.runner.sampler import Sampler, SamplingTensors, top_logprobs
from tidal.rollout.runner.sampling_inputs import SamplingInputs
from tidal.rollout.runner.steps import (
    BlockTables,
    DecodeStep,
    LaunchedStep,
    PrefillStep,
    StepPeers,
    StepResult,
    fill_decode_inputs,
    state_copies,
)
from tidal.rollout.scheduling.scheduler import ScheduledBatch
from tidal.rollout.scheduling.sequence import Sequence
from tidal.rollout.scheduling.state_cache import StateCache


def resolve_attention_backend(backend: str, device: torch.device, head_dim: int) -> str:
    """``auto``: the Triton paged kernel on CUDA when Triton is importable, else plain torch."""
    if backend != "auto":
        if backend == "triton" and device.type != "cuda":
            raise ValueError("attention_backend='triton' needs a CUDA device")
        return backend
    if device.type != "cuda" or head_dim & (head_dim - 1) or not triton_available():
        return "torch"
    return "triton"


class ModelRunner(SamplingInputs):
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
        saved_states: int = 0,
        fp8_kv_cache: bool = False,
    ):
        """``saved_states``: rows of recurrent states saved for prefix caching (state_cache.py);
        ``fp8_kv_cache``: the KV cache holds e4m3 rows and their scales (``kv_cache.py``)."""
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
        self.fp8_kv_cache = fp8_kv_cache
        self.kv_scales: torch.Tensor | None = None  # an FP8 cache's (kv_cache.py)
        # Linear-attention families: the per-sequence recurrent states, allocated and freed with the cache.
        spec = model.state_spec()
        # With steps launched ahead, a pair of slots per sequence (double buffering, state_cache.py).
        self.states = None
        if spec is not None:
            self.states = StateCache(spec, max_num_seqs, self.dtype, self.device, lookahead, saved_states)
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
        size = max_num_seqs * (2 + max_blocks + (2 if self.states is not None else 0))  # + state slots
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
            pad_state = None if self.states is None else self.states.pad_slot
            self.graphs = DecodeGraphs(self.decode_forward, self.device, max_num_seqs, max_blocks, pad_state)

    def allocate_kv_cache(self) -> None:
        self.kv_cache, self.kv_scales = kv_cache.allocate(
            self.args, self.num_blocks + 1, self.block_size, self.dtype, self.device, self.fp8_kv_cache
        )
        if self.states is not None and self.states.conv is None:
            self.states.allocate()

    def free_kv_cache(self) -> None:
        if self.graphs is not None:  # they hold the cache's (and weights') addresses
            self.graphs.clear()
        self.kv_cache = self.kv_scales = None
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
        if self.states is not None and not self.states.double:  # built without ``lookahead``: a bug
            raise RuntimeError("a step launched ahead needs double-buffered recurrent states (lookahead)")
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
            kv_cache.copy_blocks(self.kv_cache, self.kv_scales, self._tensor(src), self._tensor(dst))
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
            step.state_copies = state_copies(groups)
        if hasattr(self.model, "reserve_block_state"):
            from tidal.rollout.runner.multimodal import prefill_images

            step.positions, step.images = prefill_images(groups)
        return step

    def _copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Give the samples of a prompt the state its prefill left in the first sample's slot."""
        if copies:
            src, dst = zip(*copies, strict=True)
            self.states.copy(self._tensor(src), self._tensor(dst))

    def _token_seq(self, lens) -> torch.Tensor:
        """Each flat token's sequence index, from the host's lengths (no device sync, unlike a nonzero)."""
        return self._tensor(np.repeat(np.arange(len(lens)), lens))

    def _prefill_tensors(self, step: PrefillStep):
        lens = step.lens
        lens_t = self._tensor(lens)
        ends = torch.cumsum(lens_t, 0)
        starts = ends - lens_t
        cols = torch.arange(max(lens), device=self.device)
        valid = cols[None, :] < lens_t[:, None]
        pad_index = torch.where(valid, starts[:, None] + cols[None, :], 0)
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=torch.from_numpy(step.slots).to(self.device),
            kv_cache=self.kv_cache,
            kv_scales=self.kv_scales,
            pad_index=pad_index,
            pad_valid=valid,
            token_seq=self._token_seq(lens),
            cu_seqlens=torch.nn.functional.pad(ends, (1, 0)).int(),
            exact=self.exact,
        )
        if self.states is not None:
            meta.states, meta.state_slots = self.states, self._tensor(step.state_slots)
        positions = torch.from_numpy(step.positions).to(self.device)
        return torch.from_numpy(step.input_ids).to(self.device), positions, meta, ends - 1

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
        else:
            prev_rows, prev_tokens = ahead
            prev = (prev_rows, len(prev_tokens))
            staged = fill_decode_inputs(seqs, rows, width, self._hosts_np[buffer], prev, tables)
            step = DecodeStep(staged, n, rows, width, use_graph, buffer=buffer, ahead=prev_tokens)
        if self.states is not None:  # then each row's read and write state slots (state_cache.py)
            size = staged.size
            step.staged = self._hosts_np[buffer][: size + 2 * rows]
            self.states.decode_slots(seqs, rows, ahead is not None, step.staged[size:])
        return step

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
        tables_end = 2 * rows + rows * width
        tables = stage[2 * rows : tables_end].view(rows, width)
        state_slots = None if self.states is None else stage[tables_end:].view(2, rows)
        return self.decode_forward(ids, stage[rows : 2 * rows], tables, state_slots)

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
        is padding: it reads nothing and stores its KV into the reserved padding slot. ``state_slots``
        (families with recurrent states): [2, rows] int32, the slot each row reads its state from and the
        one it writes it to (the scratch slot for padding rows).
        """
        bs = self.block_size
        positions = (context_lens - 1).clamp(min=0)
        block = block_tables.gather(1, (positions // bs).long()[:, None])[:, 0]
        slots = torch.where(context_lens > 0, block.long() * bs + positions % bs, self.pad_slot)
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=slots,
            kv_cache=self.kv_cache,
            kv_scales=self.kv_scales,
            block_tables=block_tables,
            context_lens=context_lens,
            backend=self.backend,
            exact=self.exact,
        )
        if self.states is not None:
            slots = state_slots.long()
            meta.states, meta.state_slots, meta.state_write_slots = self.states, slots[0], slots[1]
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
        lens = [end - start for start, end in batch.chunks]
        lens_t = self._tensor(lens)
        starts = torch.cumsum(lens_t, 0) - lens_t
        cols = torch.arange(max(lens), device=self.device)
        valid = cols[None, :] < lens_t[:, None]
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=self._tensor(np.concatenate(slots)),
            kv_cache=self.kv_cache,
            kv_scales=self.kv_scales,
            pad_index=torch.where(valid, starts[:, None] + cols[None, :], 0),
            pad_valid=valid,
            token_seq=self._token_seq(lens),
            block_tables=self._tensor(padded),
            context_lens=self._tensor([end for _, end in batch.chunks]),
            query_starts=self._tensor([start for start, _ in batch.chunks]),
            backend=self.backend,
            exact=self.exact,
        )
        if self.states is not None:  # each group continues the state its earlier chunks left
            meta.states, meta.state_slots = self.states, self._tensor([g[0].state_slot for g in batch.groups])
            self._copy_states(batch.state_loads)  # prefix caching: the saved state a cached prefix ends with
        # Between chunks nothing samples; one row's logits anyway keeps every kernel's shapes non-empty.
        last = [i for i, final in enumerate(batch.final) if final] or [0]
        logits_index = (starts + lens_t - 1)[self._tensor(last)]
        if batch.copies_before:  # vision families: cached first blocks copied into the groups' own
            src, dst = zip(*batch.copies_before, strict=True)
            kv_cache.copy_blocks(self.kv_cache, self.kv_scales, self._tensor(src), self._tensor(dst))
        extra, positions = {}, np.concatenate(positions)
        if hasattr(self.model, "reserve_block_state"):  # vision families: M-RoPE positions, whole images
            from tidal.rollout.runner.multimodal import context_prefill_images

            positions, extra["images"] = context_prefill_images(batch.groups, batch.chunks)
        logits = self.model(self._tensor(ids), self._tensor(positions), meta, logits_index, **extra)
        if batch.block_copies:  # n > 1: the samples' copies of the prompt's last block, now complete
            src, dst = zip(*batch.block_copies, strict=True)
            kv_cache.copy_blocks(self.kv_cache, self.kv_scales, self._tensor(src), self._tensor(dst))
        if self.states is not None:
            self._copy_states(batch.state_saves)  # prefix caching: states at chunks ending on a block's end
            done = [group for group, final in zip(batch.groups, batch.final, strict=True) if final]
            self._copy_states(state_copies(done))
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
