"""``ModelRunner``: owns the decoder and the paged KV cache, turns a ``ScheduledBatch`` into tokens.

The KV cache is one tensor ``[layers, 2 (k, v), num_blocks, block_size, kv_heads, head_dim]`` so that a
whole block can be copied for every layer at once (prompt sharing) and freed/re-allocated in one go
(``sleep``/``wake_up``). Input preparation is host-side Python over the batch; the model forward and
the sampler are batched tensor ops.
"""

from __future__ import annotations

import torch

from tidal.rollout.attention import AttentionMetadata
from tidal.rollout.models.decoder import DecoderForCausalLM
from tidal.rollout.sampler import Sampler, SamplingTensors
from tidal.rollout.scheduler import ScheduledBatch
from tidal.rollout.sequence import Sequence


class ModelRunner:
    def __init__(
        self,
        model: DecoderForCausalLM,
        block_size: int,
        num_blocks: int,
        eos_token_ids: set[int],
    ):
        self.model = model
        self.args = model.args
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.eos_token_ids = sorted(eos_token_ids)
        self.device = model.model.embed_tokens.weight.device
        self.dtype = model.model.embed_tokens.weight.dtype
        self.sampler = Sampler()
        self.kv_cache: torch.Tensor | None = None
        self.allocate_kv_cache()

    @staticmethod
    def bytes_per_block(args, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return args.num_layers * 2 * block_size * args.num_kv_heads * args.head_dim * elem

    def allocate_kv_cache(self) -> None:
        a = self.args
        shape = (a.num_layers, 2, self.num_blocks, self.block_size, a.num_kv_heads, a.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def free_kv_cache(self) -> None:
        self.kv_cache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _tensor(self, data, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[int], list[float]]:
        if batch.is_prefill:
            input_ids, positions, meta, logits_index, rows = self._prepare_prefill(batch.groups)
        else:
            input_ids, positions, meta = self._prepare_decode(batch.seqs)
            logits_index = rows = None
        logits = self.model(input_ids, positions, meta, logits_index)
        if batch.block_copies:
            src, dst = zip(*batch.block_copies, strict=True)
            self.kv_cache[:, :, self._tensor(dst)] = self.kv_cache[:, :, self._tensor(src)]
        if rows is not None:  # one prefill row per group -> one sampling row per sample
            logits = logits[rows]
        tokens, logprobs = self.sampler(logits, self._sampling_tensors(batch.seqs))
        return tokens.tolist(), logprobs.tolist()

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def _prepare_prefill(self, groups: list[list[Sequence]]):
        input_ids, positions, slots, lens = [], [], [], []
        for group in groups:
            seq = group[0]
            input_ids.extend(seq.token_ids)
            positions.extend(range(seq.num_tokens))
            slots.extend(self._slots(seq.block_table, 0, seq.num_tokens))
            lens.append(seq.num_tokens)
        lens_t = self._tensor(lens)
        starts = torch.cumsum(lens_t, 0) - lens_t
        cols = torch.arange(max(lens), device=self.device)
        valid = cols[None, :] < lens_t[:, None]
        pad_index = torch.where(valid, starts[:, None] + cols[None, :], 0)
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=self._tensor(slots),
            kv_cache=self.kv_cache,
            pad_index=pad_index,
            pad_valid=valid,
            unpad_index=valid.view(-1).nonzero().view(-1),
        )
        rows = self._tensor([i for i, group in enumerate(groups) for _ in group])
        return self._tensor(input_ids), self._tensor(positions), meta, starts + lens_t - 1, rows

    def _prepare_decode(self, seqs: list[Sequence]):
        bs = self.block_size
        positions = [seq.num_tokens - 1 for seq in seqs]
        slots = [seq.block_table[p // bs] * bs + p % bs for seq, p in zip(seqs, positions, strict=True)]
        width = max(len(seq.block_table) for seq in seqs)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs]
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=self._tensor(slots),
            kv_cache=self.kv_cache,
            block_tables=self._tensor(tables),
            context_lens=self._tensor([seq.num_tokens for seq in seqs]),
        )
        return self._tensor([seq.last_token for seq in seqs]), self._tensor(positions), meta

    def _sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        vocab = self.args.vocab_size
        params = [seq.params for seq in seqs]
        suppress = [
            (row, token)
            for row, seq in enumerate(seqs)
            if seq.num_output_tokens < seq.params.min_new_tokens
            for token in self._stop_ids(seq)
            if token < vocab
        ]
        suppress_rows = self._tensor([r for r, _ in suppress]) if suppress else None
        suppress_tokens = self._tensor([t for _, t in suppress]) if suppress else None
        if all(p.greedy for p in params):
            return SamplingTensors(
                all_greedy=True, suppress_rows=suppress_rows, suppress_tokens=suppress_tokens
            )
        return SamplingTensors(
            all_greedy=False,
            any_truncation=any(p.needs_truncation and not p.greedy for p in params),
            temperatures=self._tensor([p.temperature for p in params], torch.float32),
            top_k=self._tensor([p.top_k if p.top_k > 0 else vocab for p in params]),
            top_p=self._tensor([p.top_p for p in params], torch.float32),
            min_p=self._tensor([p.min_p for p in params], torch.float32),
            seeds=self._tensor([seq.noise_seed for seq in seqs]),
            positions=self._tensor([seq.num_output_tokens for seq in seqs]),
            suppress_rows=suppress_rows,
            suppress_tokens=suppress_tokens,
        )

    def _stop_ids(self, seq: Sequence) -> list[int]:
        eos = [] if seq.params.ignore_eos else self.eos_token_ids
        return sorted(set(eos) | set(seq.params.stop_token_ids))
