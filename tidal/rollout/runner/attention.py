"""Paged attention in plain PyTorch: KV stores into cache slots, padded prefill and batched decode.

Tokens travel through the model flattened (``[num_tokens, ...]``, sequences back to back, as in vLLM).
``AttentionMetadata`` carries what the attention layers need for one step:

- prefill: each sequence's fresh keys/values are attended directly (no cached prefix is read): on CUDA in
  half precision by torch's variable-length flash attention over the flat tokens (``cu_seqlens``: no
  padding, no mask), else gathered into a right-padded ``[batch, max_len]`` layout for one SDPA call with
  a causal + padding mask;
- decode: one query per sequence; its keys/values are gathered from the paged cache through the block
  tables (``[batch, max_blocks * block_size]``) and masked by context length;
- prefill with context (prefix caching, chunked prefill: ``block_tables`` set on a prefill): each
  sequence's tokens ``[start, end)`` are queries (padded as in prefill) and its keys/values ``[0, end)``
  are gathered from the paged cache (the fresh ones were just stored there), with a causal mask offset by
  ``start`` (``query_starts``) and ``context_lens`` = ``end``.

Both paths are a fixed number of batched ops per layer with no per-sequence Python, and decode shapes
depend only on (batch, max_blocks), so a decode step can be captured in a CUDA graph.

Decode has two backends (``AttentionMetadata.backend``): ``"torch"`` (above; runs anywhere, but reads
every slot of the block-table width, padding included) and ``"triton"`` (``triton_attention.py``: a
paged kernel that reads only each sequence's live context; GPU only). Prefill with context follows the
same switch: ``"triton"`` runs ``kernels/triton_context.py``'s paged kernel (no gathered copy, no dense mask).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tidal.rollout.kernels import flash_varlen
from tidal.rollout.runner import kv_cache


@dataclass
class AttentionMetadata:
    is_prefill: bool
    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each token's KV
    kv_cache: torch.Tensor | None = None  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    # FP8 cache (``kv_cache.py``): the e4m3 rows' float32 scales, [layers, 2, blocks, block_size, kv_heads]
    kv_scales: torch.Tensor | None = None
    # prefill: flat token index of each padded position, and which padded positions are real
    pad_index: torch.Tensor | None = None  # [batch, max_len]
    pad_valid: torch.Tensor | None = None  # [batch, max_len] bool
    token_seq: torch.Tensor | None = None  # [num_tokens] each flat token's sequence (row of pad_index)
    # prefill without context: [batch + 1] int32, each sequence's first flat token, then the token count
    cu_seqlens: torch.Tensor | None = None
    # decode
    block_tables: torch.Tensor | None = None  # [batch, max_blocks]
    context_lens: torch.Tensor | None = None  # [batch]; 0 marks a CUDA-graph padding row
    query_starts: torch.Tensor | None = None  # prefill with context: [batch] position of the first query
    backend: str = "torch"  # decode and context-prefill attention: "torch" or "triton"
    exact: bool = False  # batch-invariant attention (``exact_attention``; EngineConfig.exact_logprobs)
    # Linear-attention families: the recurrent-state pool (``state_cache.StateCache``) and each
    # sequence's slot in it ([batch]; prefill: one per group, decode: one per row).
    states: object | None = None
    state_slots: torch.Tensor | None = None
    # decode: the slot each row writes its new state to (double buffering); None: in place, ``state_slots``
    state_write_slots: torch.Tensor | None = None
    # prefill: ``[batch, max_len]`` start and end (key positions) of the image each padded query belongs
    # to (start == end: none); those keys are attended bidirectionally (Gemma 3, ``image_spans``)
    image_spans: tuple[torch.Tensor, torch.Tensor] | None = None
    image_spans_sliding_only: bool = False  # Gemma 4: bidirectional in sliding-window layers only
    _masks: dict = field(default_factory=dict)
    _decode_positions: torch.Tensor | None = None

    def layer_scales(self, layer_idx: int) -> torch.Tensor | None:
        """The FP8 cache's scales of layer ``layer_idx`` (None: the cache is in the model dtype)."""
        return None if self.kv_scales is None else self.kv_scales[layer_idx]

    def decode_positions(self) -> torch.Tensor:
        """Each decode row's query position ``[batch, 1]`` (a CUDA-graph padding row reads slot 0), computed
        once a step rather than once a layer."""
        if self._decode_positions is None:
            self._decode_positions = (self.context_lens.long() - 1).clamp(min=0)[:, None]
        return self._decode_positions

    def mask(self, window: int | None) -> torch.Tensor:
        """Boolean attention mask (True = attend), cached per sliding-window size for the step."""
        if window not in self._masks:
            if not self.is_prefill:
                self._masks[window] = self._decode_mask(window)
            elif self.block_tables is not None:
                self._masks[window] = self._context_mask(window)
            else:
                self._masks[window] = self._prefill_mask(window)
        return self._masks[window]

    def _context_mask(self, window: int | None) -> torch.Tensor:
        device = self.pad_index.device
        cols = torch.arange(self.pad_index.shape[1], device=device)
        last = self.pad_valid.sum(1, keepdim=True) - 1
        # A padding query row repeats the sequence's last query (a row with nothing to attend is NaN).
        q = self.query_starts[:, None] + torch.minimum(cols[None, :], last)  # [batch, q] positions
        k = torch.arange(self.block_tables.shape[1] * self.kv_cache.shape[3], device=device)
        mask = self._or_image_spans(k[None, None, :] <= q[:, :, None], k, window)
        if window is not None:
            mask &= k[None, None, :] > q[:, :, None] - window
        return mask[:, None]  # [batch, 1, q, k]

    def _prefill_mask(self, window: int | None) -> torch.Tensor:
        length = self.pad_index.shape[1]
        q = torch.arange(length, device=self.pad_index.device)
        mask = self._or_image_spans((q[None, :] <= q[:, None])[None], q, window) & self.pad_valid[:, None, :]
        if window is not None:
            mask &= (q[None, :] > q[:, None] - window)[None]
        return mask[:, None]  # [batch, 1, q, k]

    def _or_image_spans(self, mask: torch.Tensor, k: torch.Tensor, window: int | None) -> torch.Tensor:
        """``mask`` ([batch or 1, q, k], True = attend) also attending, from each query inside an image, to
        every key of that image (before the sliding window applies, as transformers' Gemma 3; Gemma 4:
        in sliding-window layers only)."""
        if self.image_spans is None or (self.image_spans_sliding_only and window is None):
            return mask
        start, end = self.image_spans
        return mask | ((k[None, None, :] >= start[:, :, None]) & (k[None, None, :] < end[:, :, None]))

    def _decode_mask(self, window: int | None) -> torch.Tensor:
        num_slots = self.block_tables.shape[1] * self.kv_cache.shape[3]
        k = torch.arange(num_slots, device=self.context_lens.device)
        mask = k[None, :] < self.context_lens[:, None]
        if window is not None:
            mask &= k[None, :] > self.context_lens[:, None] - 1 - window
        return mask[:, None, None, :]  # [batch, 1, 1, k]


def store_kv(
    layer_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    layer_scales: torch.Tensor | None = None,
) -> None:
    """Write the step's keys/values ([tokens, kv_heads, head_dim]) into their cache slots (quantized, with
    ``layer_scales``: an FP8 cache, ``kv_cache.store``)."""
    if layer_scales is not None:
        kv_cache.store(layer_cache, layer_scales, k, v, slot_mapping)
        return
    flat = layer_cache.view(2, -1, *k.shape[1:])
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def prefill_attention(
    q,
    k,
    v,
    meta: AttentionMetadata,
    window: int | None,
    scale: float,
    layer_cache: torch.Tensor | None = None,
    layer_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [tokens, heads, d], k/v [tokens, kv_heads, d] -> [tokens, heads * d]. A prefill without context
    attends its own k/v as computed (an FP8 cache's rounding reaches only the keys read back from it)."""
    if meta.block_tables is not None:
        return context_prefill_attention(q, layer_cache, meta, window, scale, layer_scales)
    if FLASH_PREFILL and flash_prefill_usable(q, k, v, meta, window):
        return flash_prefill_attention(q, k, v, meta, window, scale)
    idx = meta.pad_index
    qp, kp, vp = (x[idx].transpose(1, 2) for x in (q, k, v))  # [batch, heads, len, d]
    out = F.scaled_dot_product_attention(
        qp, kp, vp, attn_mask=meta.mask(window), scale=scale, enable_gqa=True
    )
    out = out.transpose(1, 2)[meta.pad_valid]  # back to flat token order
    return out.reshape(q.shape[0], -1)


# False: a prefill without context always takes the padded SDPA call (tests and benchmarks compare the two;
# read at each call).
FLASH_PREFILL = True


def flash_prefill_usable(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, window: int | None = None
) -> bool:
    """Whether ``flash_prefill_attention`` takes this prefill: CUDA, half precision, one head dim for q, k
    and v (a multiple of 8, at most 256: MLA's wider q/k and Gemma 4's 512-wide global heads stay padded),
    no image spans (their bidirectional blocks are a mask), a GPU and torch build with flash attention (and
    for a sliding window a ``varlen_attn`` that takes one)."""
    return (
        meta.cu_seqlens is not None
        and meta.image_spans is None
        and q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] == k.shape[-1] == v.shape[-1]
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 256
        and torch.backends.cuda.flash_sdp_enabled()  # a user's switch, read at each call
        and _flash_runs(q.device)
        and (window is None or flash_varlen.takes_window())
    )


@functools.cache
def _flash_runs(device: torch.device) -> bool:
    """torch's varlen flash kernels run on ``device``: shipped, and an Ampere or newer GPU."""
    return flash_varlen.kernel_available() and torch.cuda.get_device_capability(device) >= (8, 0)


def flash_prefill_attention(
    q, k, v, meta: AttentionMetadata, window: int | None, scale: float
) -> torch.Tensor:
    """q [tokens, heads, d], k/v [tokens, kv_heads, d] (sequences back to back, ``meta.cu_seqlens``) ->
    [tokens, heads * d]: ``flash_varlen.causal_varlen``, each sequence over its own tokens. No padded
    copies of q/k/v or of the output, no dense mask and no host sync (the padded path's boolean unpadding
    waits for the device): at 16 prompts of 1,024 tokens (7B, bf16, H200) its gathers and masked SDPA
    took 1.47 ms a layer, this 0.72."""
    length = meta.pad_index.shape[1]  # the longest sequence
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out = flash_varlen.causal_varlen(q, k, v, meta.cu_seqlens, length, scale, window)
    return out.reshape(q.shape[0], -1)


def decode_attention(
    q, layer_cache: torch.Tensor, meta: AttentionMetadata, window: int | None, scale: float, layer_scales=None
):
    """q [batch, heads, d] against the paged cache (FP8: with its ``layer_scales``) -> [batch, heads * d]."""
    if meta.backend == "triton":
        from tidal.rollout.kernels.triton_attention import paged_decode_attention

        return paged_decode_attention(
            q, layer_cache, meta.block_tables, meta.context_lens, window, scale, kv_scales=layer_scales
        )
    return torch_decode_attention(q, layer_cache, meta, window, scale, layer_scales)


def torch_decode_attention(
    q, layer_cache: torch.Tensor, meta: AttentionMetadata, window: int | None, scale, layer_scales=None
):
    """Gather every block of the block-table width, then one masked SDPA call."""
    batch = q.shape[0]
    kv = kv_cache.gather(layer_cache, layer_scales, meta.block_tables, q.dtype)
    kv = kv.transpose(2, 3)  # [2, batch, kv_heads, slots, d]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], kv[0], kv[1], attn_mask=meta.mask(window), scale=scale, enable_gqa=True
    )
    return out.reshape(batch, -1)


# False: prefill with context always takes the torch path (benchmarks compare the two; read at each call).
CONTEXT_KERNEL = True


def context_prefill_attention(
    q, layer_cache: torch.Tensor, meta: AttentionMetadata, window: int | None, scale, layer_scales=None
):
    """Prefill queries [tokens, heads, d] against their sequences' cached keys/values (the prefix and the
    tokens just stored) -> [tokens, heads * d].

    With the Triton backend (CUDA) and a head dim it compiles for: ``kernels/triton_context.py``'s kernel reads
    the pages in place. Otherwise one masked SDPA call over the gathered blocks."""
    if meta.backend == "triton" and CONTEXT_KERNEL and meta.image_spans is None:  # the kernel is causal
        from tidal.rollout.kernels import triton_context

        if triton_context.supports(q.shape[-1]):
            return context_kernel_attention(q, layer_cache, meta, window, scale, layer_scales=layer_scales)
    return torch_context_prefill_attention(q, layer_cache, meta, window, scale, layer_scales)


def context_kernel_attention(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int | None,
    scale: float,
    num_splits: int | None = None,
    sinks: torch.Tensor | None = None,
    layer_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """``triton_context.paged_context_attention`` for a prefill step, its index arguments read from the
    step's metadata: each sequence's first query row (``pad_index[:, 0]``: lengths are >= 1), query start
    and end positions, and the longest run of new tokens (the width of ``pad_index``)."""
    from tidal.rollout.kernels import triton_context

    return triton_context.paged_context_attention(
        q,
        layer_cache,
        meta.block_tables,
        meta.pad_index[:, 0],
        meta.query_starts,
        meta.context_lens,
        meta.pad_index.shape[1],
        window,
        scale,
        num_splits,
        sinks,
        layer_scales,
    )


def torch_context_prefill_attention(
    q, layer_cache: torch.Tensor, meta: AttentionMetadata, window: int | None, scale, layer_scales=None
):
    """One masked SDPA call over each sequence's gathered blocks, queries padded to the longest."""
    qp = q[meta.pad_index].transpose(1, 2)  # [batch, heads, len, d]
    kv = kv_cache.gather(layer_cache, layer_scales, meta.block_tables, q.dtype)
    kv = kv.transpose(2, 3)  # [2, batch, kv_heads, slots, d]
    out = F.scaled_dot_product_attention(
        qp, kv[0], kv[1], attn_mask=meta.mask(window), scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2)[meta.pad_valid].reshape(q.shape[0], -1)


def exact_attention(q, k, v, meta: AttentionMetadata, layer_cache: torch.Tensor, window: int | None, scale):
    """Every path (prefill, decode, prefill with context) through ``batch_invariant.attention``, whose
    result for a query does not depend on the step's other sequences or on how many keys it gathers:
    q [tokens, heads, d] -> [tokens, heads * d]."""
    from tidal.rollout.batch_invariant import attention

    if meta.is_prefill and meta.block_tables is None:  # the batch's own keys, at positions 0..len-1
        idx = meta.pad_index
        q_pos = torch.arange(idx.shape[1], device=q.device).expand(idx.shape)
        out = attention(q[idx], k[idx], v[idx], q_pos, scale, window)
        return out[meta.pad_valid].reshape(q.shape[0], -1)
    if meta.is_prefill:  # queries [start, end) of each sequence against its cached keys
        cols = torch.arange(meta.pad_index.shape[1], device=q.device)
        q_pos = meta.query_starts[:, None] + cols[None, :]
        out = _exact_cached_attention(q[meta.pad_index], q_pos, meta, layer_cache, window, scale)
        return out[meta.pad_valid].reshape(q.shape[0], -1)
    out = _exact_cached_attention(q[:, None], meta.decode_positions(), meta, layer_cache, window, scale)
    return out.reshape(q.shape[0], -1)


def _exact_cached_attention(q, q_pos, meta: AttentionMetadata, layer_cache: torch.Tensor, window, scale):
    """``batch_invariant.attention`` of ``q [batch, Lq, heads, d]`` over each row's cached keys, key ``j`` at
    slot ``j % page`` of block ``block_tables[row, j // page]``. On the Triton kernels (CUDA) the kernel reads
    the pages in place (``triton_exact.paged_attention``: the same key blocks in the same order, so the
    same bits); elsewhere the block table's whole width is gathered first."""
    from tidal.rollout.batch_invariant import attention, dispatch

    if dispatch.on_triton(q):
        kernels = dispatch.kernels()
        return kernels.paged_attention(q, layer_cache, meta.block_tables, q_pos, scale, window)
    batch = meta.block_tables.shape[0]
    blocks = layer_cache.flatten(2).index_select(1, meta.block_tables.view(-1))
    kv = blocks.view(2, batch, -1, *layer_cache.shape[-2:])  # [2, batch, slots, kv_heads, d]
    return attention(q, kv[0], kv[1], q_pos, scale, window)


def image_spans(
    is_image: torch.Tensor, query_starts: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``AttentionMetadata.image_spans`` from ``is_image`` ``[batch, max_len]`` (padded queries that are
    image tokens; each run of them is one image, as transformers' Gemma 3 groups them), in key positions:
    offset by ``query_starts`` for a prefill with context."""
    cols = torch.arange(is_image.shape[1], device=is_image.device).expand_as(is_image)
    before = torch.nn.functional.pad(is_image, (1, 0))[:, :-1]
    after = torch.nn.functional.pad(is_image, (0, 1))[:, 1:]
    big = is_image.shape[1]
    # each image token's run: the last run start at or before it, the first run end at or after it
    start = torch.where(is_image & ~before, cols, 0).cummax(1).values
    end = torch.where(is_image & ~after, cols + 1, big).flip(1).cummin(1).values.flip(1)
    start, end = torch.where(is_image, start, 0), torch.where(is_image, end, 0)
    if query_starts is not None:
        start, end = start + query_starts[:, None], end + query_starts[:, None]
    return start, end
