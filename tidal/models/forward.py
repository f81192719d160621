"""Forward passes over padded or packed batches, and per-token log-probs of the input tokens.

Batches come from ``tidal.data.collate``: padded batches carry a 2-D ``attention_mask``; packed
batches put several samples in one row and carry ``segment_ids`` (position ids restart per sample,
so RoPE sees each sample as if it were alone). No token may attend across a sample boundary:

- on CUDA, SDPA models switch to ``tidal_varlen`` (``packed_attention.py``): flash-attention varlen
  kernels over the samples' cumulative lengths, no mask and no padding;
- elsewhere (the CPU, eager attention, vision-language models) we build a ``[B, 1, T, T]``
  block-diagonal causal mask.

``token_logprobs`` never materialises ``[B, T, V]`` logits for supported families: the LM head runs
in checkpointed chunks (``logprob_head.py``); ``outputs.logits`` is still there, computed on demand.

Under ``--ring_attn_size N`` (``ring_attention.use_ring``) a packed row is split along the sequence
across the ring group and each rank runs the model on its chunk (``ring_token_logprobs``); the targets
are the row's next tokens taken before the split, so a chunk's last token is scored against the next
chunk's first, and the per-token log-probs are gathered back into the whole row on every rank.
``ring_chunk`` gives the other ring forwards their chunk (``RingChunk``: the local inputs, a whole-row
tensor's local slice, per-token values gathered back): the value head's values (RM, the PPO critic),
PRM's step logits, KD's per-token loss.

A batch with images (vision-language models) also passes ``pixel_values``, ``image_grid_thw`` and the
model's multimodal rotary positions (``tidal.models.vision.vision_kwargs``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from tidal.algorithms.logprobs import entropy_from_logits, gather_logprobs
from tidal.models import ring_attention as ring_attn
from tidal.models.logprob_head import (
    DEFAULT_CHUNK,
    LogprobOutputs,
    chunkable_head,
    chunked_logprobs,
    head_logprobs,
    head_values,
)
from tidal.models.packed_attention import enable_varlen_attention, varlen_kwargs
from tidal.models.vision import vision_kwargs, vision_lm_head
from tidal.rollout import batch_invariant

# "auto": varlen kernels for packed rows where possible; "mask": always the 4-D mask (benchmarks).
PACKED_ATTENTION = "auto"
_VARLEN_IMPLS = ("tidal_varlen", "flash_attention_2", "flash_attention_3")


def packed_attention_mask(
    segment_ids: torch.Tensor, additive: bool = False, window: int | None = None
) -> torch.Tensor:
    """[B, 1, T, T] mask: causal within a segment, blocked across segments.

    Boolean (True = may attend) for ``sdpa``; ``eager`` attention adds the mask to the scores, so it
    gets a float32 additive mask instead.
    """
    t = segment_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=segment_ids.device).tril()
    if window is not None:  # a sliding-window layer also sees only the last ``window`` keys
        causal = causal.triu(1 - window)
    allowed = (causal & (segment_ids[:, :, None] == segment_ids[:, None, :]))[:, None]
    if not additive:
        return allowed
    mask = torch.zeros(allowed.shape, dtype=torch.float32, device=segment_ids.device)
    return mask.masked_fill(~allowed, torch.finfo(torch.float32).min)


def _packs_varlen(model: nn.Module, batch: dict) -> bool:
    """Whether this packed batch runs through varlen kernels (one row on CUDA, a varlen-capable model)."""
    if PACKED_ATTENTION != "auto" or batch["input_ids"].shape[0] != 1:
        return False
    if getattr(getattr(model, "config", None), "vision_config", None) is not None:
        # a VLM's forward hands its keyword arguments to the vision tower too, whose attention has
        # sample boundaries of its own: packed rows keep the block-diagonal mask
        return False
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl in _VARLEN_IMPLS:
        return True
    return batch["input_ids"].is_cuda and enable_varlen_attention(model)


def model_inputs(model: nn.Module, batch: dict) -> dict:
    """Keyword arguments for a HF model's forward from a collated batch."""
    kwargs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    if "segment_ids" not in batch:
        kwargs["attention_mask"] = batch["attention_mask"]
    elif _packs_varlen(model, batch):
        kwargs["attention_mask"] = None
        kwargs.update(varlen_kwargs(batch))
    else:
        impl = getattr(getattr(model, "config", None), "_attn_implementation", "sdpa")
        kwargs["attention_mask"] = _packed_masks(model, batch["segment_ids"], additive=impl == "eager")
    return {**kwargs, **vision_kwargs(model, batch)}  # images: pixels, grids, multimodal positions


def _packed_masks(model: nn.Module, segment_ids: torch.Tensor, additive: bool):
    """The packed mask; for a model with sliding-window layers (Gemma, Qwen2 with ``use_sliding_window``)
    a ``{layer kind: mask}`` mapping, as HF's own mask creation makes, so those layers keep their window."""
    config = getattr(model, "config", None)
    mask = packed_attention_mask(segment_ids, additive)
    window = getattr(config, "sliding_window", None)
    if window is None or "sliding_attention" not in (getattr(config, "layer_types", None) or ()):
        return mask
    return {"full_attention": mask, "sliding_attention": packed_attention_mask(segment_ids, additive, window)}


def token_logprobs(
    model: nn.Module,
    batch: dict,
    temperature: float = 1.0,
    chunk_size: int | None = DEFAULT_CHUNK,
    with_entropy: bool = False,
    **forward_kwargs,
):
    """Per-token log p(token_t | tokens_<t) aligned with ``input_ids`` ([B, T]; position 0 is 0).

    Returns ``(logprobs, outputs)`` so callers can also use e.g. ``outputs.aux_loss``. With
    ``with_entropy``, ``outputs.entropy`` holds the per-token entropy of the same distributions
    (aligned like the log-probs). ``chunk_size=None`` (or an unsupported model) takes the plain path:
    full logits, then ``gather_logprobs``.
    """
    if batch_invariant.is_exact(model):
        return exact_token_logprobs(model, batch, temperature, with_entropy, chunk_size, **forward_kwargs)
    ring = ring_attn.active_ring()
    if ring is not None and "segment_ids" in batch:
        return ring_token_logprobs(
            model, batch, ring, temperature, chunk_size, with_entropy, **forward_kwargs
        )
    return _default_token_logprobs(model, batch, temperature, chunk_size, with_entropy, **forward_kwargs)


def _default_token_logprobs(
    model: nn.Module,
    batch: dict,
    temperature: float,
    chunk_size: int | None,
    with_entropy: bool,
    **forward_kwargs,
):
    """``token_logprobs``' default path: the chunked LM head where it applies, else full logits."""
    head = (chunkable_head(model) or vision_lm_head(model)) if chunk_size else None
    inputs = model_inputs(model, batch)
    if head is None:
        outputs = model(**inputs, use_cache=False, **forward_kwargs)
        ids = batch["input_ids"]
        lp = gather_logprobs(outputs.logits[:, :-1], ids[:, 1:], temperature)
        lp = torch.cat([lp.new_zeros(ids.shape[0], 1), lp], dim=1)
        if with_entropy:
            ent = entropy_from_logits(outputs.logits[:, :-1], temperature, chunk_size=1024)
            outputs.entropy = torch.cat([ent.new_zeros(ids.shape[0], 1), ent], dim=1)
        return lp, outputs
    with head_logprobs(head, batch["input_ids"], temperature, chunk_size, with_entropy) as result:
        outputs = model(**inputs, use_cache=False, **forward_kwargs)
    return result.logprobs, LogprobOutputs(outputs, head, result)


def exact_token_logprobs(
    model: nn.Module,
    batch: dict,
    temperature: float,
    with_entropy: bool = False,
    chunk_size: int | None = DEFAULT_CHUNK,
    **forward_kwargs,
):
    """``token_logprobs`` of a model switched by ``batch_invariant.make_exact``: the batch-invariant forward,
    its LM head (the batch-invariant linear) and the batch-invariant log-softmax the engine's sampler also
    runs, ``chunk_size`` tokens at a time (``_exact_token_values``; ``None`` or a head that is not a plain linear:
    full logits first). The attention reads samples from ``position_ids`` (their layout computed once,
    ``batch_invariant.segment_layout``), so padded and packed rows need no mask. The model computes in the
    engine's dtype (``batch_invariant.use_engine_numerics``) with autocast off: autocast would re-cast
    between the ops (e.g. run ``exp`` in float32 where the engine runs it in bf16).

    Where grad is enabled (the policy loss) that forward runs without it, for the values only, and a
    second, default forward (``spliced_logprobs``) gives the gradient: the exact ops' own backward is
    slow and nothing needs it (only the log-probs must equal the engine's). Compiled blocks
    (``--torch_compile``) run the exact forward eagerly and the default one compiled."""
    ids = batch["input_ids"]
    grad = torch.is_grad_enabled()
    # Eagerly, where ``--torch_compile`` compiled the blocks: inductor fuses the elementwise ops between the
    # exact kernels and rounds once where eager torch (and the engine) round after each op.
    eager = torch.compiler.set_stance("force_eager")
    with torch.no_grad(), batch_invariant.exact_autocast_off(ids.device), _hooks_off(model, grad), eager:
        lp, outputs = _exact_values(
            model, batch, temperature, chunk_size, with_entropy and not grad, **forward_kwargs
        )
    if grad:
        with batch_invariant.default_attention(model):  # the chunked head puts the exact head back after
            fast, outputs = _default_token_logprobs(
                model, batch, temperature, DEFAULT_CHUNK, with_entropy, **forward_kwargs
            )
        return spliced_logprobs(lp, fast), outputs
    return lp, outputs


def _exact_values(model, batch, temperature, chunk_size, with_entropy, **forward_kwargs):
    """The exact forward's ``(logprobs [B, T], outputs)`` (no grad): chunked where the head allows."""
    ids = batch["input_ids"]
    inputs = {
        "input_ids": ids,
        "position_ids": batch["position_ids"],
        "attention_mask": None,
        # every layer's attention takes this one layout (its host syncs once per forward, not per layer)
        batch_invariant.SEGMENTS_KWARG: batch_invariant.segment_layout(batch["position_ids"]),
    }
    head = chunkable_head(model) if chunk_size else None
    if head is not None:
        values = _exact_token_values(head, temperature, chunk_size, with_entropy)
        with head_logprobs(head, ids, temperature, chunk_size, with_entropy, values) as result:
            outputs = model(**inputs, use_cache=False, **forward_kwargs)
        return result.logprobs, LogprobOutputs(outputs, head, result)
    # the head is not a plain linear (e.g. LoRA on lm_head): its own forward, full [B, T, V] logits
    outputs = model(**inputs, use_cache=False, **forward_kwargs)
    lp = batch_invariant.token_logprobs(outputs.logits[:, :-1], ids[:, 1:], temperature)
    lp = torch.cat([lp.new_zeros(ids.shape[0], 1), lp], dim=1)
    if with_entropy:
        ent = entropy_from_logits(outputs.logits[:, :-1], temperature, chunk_size=1024)
        outputs.entropy = torch.cat([ent.new_zeros(ids.shape[0], 1), ent], dim=1)
    return lp, outputs


def _exact_token_values(head: nn.Linear, temperature: float, chunk_size: int, with_entropy: bool):
    """``head_logprobs``' per-token values for exact mode: ``chunk_size`` tokens at a time, the batch-invariant
    ``linear`` then ``token_logprobs``, so at most one chunk's logits exist. The values are the full logits'
    bit for bit: each row of ``linear`` (and of the log-softmax) is a function of that row alone, whatever
    rows share the call (tests/models/test_exact_head.py)."""

    def values(flat: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        # the weight in the compute dtype once (``linear`` would round a float32 master copy per chunk)
        weight = head.weight.to(flat.dtype)
        bias = None if head.bias is None else head.bias.to(flat.dtype)
        logps, ents = [], []
        for h, t in zip(flat.split(chunk_size), targets.split(chunk_size), strict=True):
            z = batch_invariant.linear(h, weight, bias)
            logps.append(batch_invariant.token_logprobs(z, t, temperature))
            if with_entropy:
                ents.append(entropy_from_logits(z, temperature, chunk_size=1024))
        return torch.cat(logps), (torch.cat(ents) if with_entropy else None)

    return values


def default_token_logprobs(
    model: nn.Module, batch: dict, temperature: float = 1.0, with_entropy: bool = False, **forward_kwargs
):
    """``token_logprobs``' default path for a model switched by ``batch_invariant.make_exact`` (its own
    attention and, with grad enabled, its layers' default ops): the forward that gives exact mode's
    gradient, for a caller that holds the exact values already (``PolicyLoss``: on an on-policy step they
    are the engine's, bit for bit)."""
    with batch_invariant.default_attention(model):
        return _default_token_logprobs(
            model, batch, temperature, DEFAULT_CHUNK, with_entropy, **forward_kwargs
        )


def spliced_logprobs(exact: torch.Tensor, fast: torch.Tensor) -> torch.Tensor:
    """``exact`` as the value, ``fast``'s gradient (straight through): ``exact + (fast - fast)``, where
    ``fast - fast`` is exactly 0 for finite values, so the sum is ``exact`` bit for bit (a -0.0 becomes
    +0.0, which compares equal) while autograd sees ``d fast``."""
    return exact.detach() + (fast - fast.detach())


@contextlib.contextmanager
def _hooks_off(model: nn.Module, off: bool):
    """Within (when ``off``): the MoE routers' forward hooks do not fire. The aux loss's router-logit
    capture then sees only the differentiable forward's logits; router replay's hook, which recomputes the
    routing weights with plain torch ops, would change the exact values, and the exact router picks the
    engine's experts by construction. Other modules keep theirs (FSDP2 gathers weights in hooks)."""
    from tidal.models.moe_routing import router_modules

    routers = router_modules(model) if off else []
    saved = [dict(r._forward_hooks) for r in routers]
    for r in routers:
        r._forward_hooks.clear()
    try:
        yield
    finally:
        for r, hooks in zip(routers, saved, strict=True):
            r._forward_hooks.update(hooks)


class RingOutputs:
    """What a ring forward returns besides the log-probs: ``entropy`` (whole row, aligned like them) and
    the model's other outputs. Logits exist only per chunk, so ``logits`` is refused."""

    def __init__(self, outputs, entropy: torch.Tensor | None):
        self._outputs, self.entropy = outputs, entropy

    @property
    def logits(self):
        raise RuntimeError("a ring-attention forward keeps no whole-row logits; use the log-probs")

    def __getattr__(self, name: str):
        return getattr(self._outputs, name)


@dataclass(frozen=True)
class RingChunk:
    """This rank's chunk of a packed ``[1, T]`` row split over a ring group (every rank of the group holds
    the whole row): the row is padded to a multiple of the ring size (the padding is a segment of its
    own, attended by nothing real) and rank r runs the model on the r-th contiguous chunk."""

    ring: ring_attn.RingGroup
    layout: ring_attn.RingLayout
    inputs: dict  # the local ``input_ids`` and ``position_ids`` [1, L]
    length: int  # T: the row's real length

    def local(self, row: torch.Tensor, pad_value: float | int = 0) -> torch.Tensor:
        """This rank's chunk of a whole-row ``[1, T]`` tensor (padded with ``pad_value``)."""
        return ring_attn.local_chunk(ring_attn.pad_row(row, self.ring.size, pad_value), self.ring)

    def counts(self, row_mask: torch.Tensor) -> list[int]:
        """How many positions of a whole-row ``[1, T]`` mask fall in each rank's chunk."""
        padded = ring_attn.pad_row(row_mask.long(), self.ring.size, 0)
        return padded.view(self.ring.size, -1).sum(-1).tolist()

    def model_kwargs(self, model: nn.Module) -> dict:
        """Forward keyword arguments of ``model`` for the chunk (switching its attention to the ring)."""
        ring_attn.switch_to_ring(model)
        return dict(self.inputs, attention_mask=None, tidal_ring=self.layout)

    def whole(self, local: torch.Tensor) -> torch.Tensor:
        """Per-token values ``[1, L]`` of every rank's chunk → the whole row ``[1, T]`` (differentiable:
        each rank keeps the gradient of its chunk; see ``ring_attention.gather_chunks``)."""
        return ring_attn.gather_chunks(local, self.ring)[:, : self.length]


def ring_chunk(batch: dict, ring: ring_attn.RingGroup | None = None) -> RingChunk | None:
    """This rank's ``RingChunk`` of a packed one-row batch under ring attention (``ring``, default the
    active one of ``ring_attention.use_ring``), or None (no ring, or a padded batch)."""
    ring = ring if ring is not None else ring_attn.active_ring()
    if ring is None or "segment_ids" not in batch:
        return None
    ids = batch["input_ids"]
    if ids.shape[0] != 1:
        raise ValueError(f"ring attention takes one packed row, got {ids.shape[0]}")
    segments = batch["segment_ids"]
    padded_segments = ring_attn.pad_row(segments, ring.size, int(segments.max()) + 1)
    local = {
        k: ring_attn.local_chunk(ring_attn.pad_row(batch[k], ring.size, 0), ring)
        for k in ("input_ids", "position_ids")
    }
    layout = ring_attn.RingLayout(ring, padded_segments[0], local["input_ids"].shape[1])
    return RingChunk(ring, layout, local, ids.shape[1])


def ring_token_logprobs(
    model: nn.Module,
    batch: dict,
    ring: ring_attn.RingGroup,
    temperature: float = 1.0,
    chunk_size: int | None = DEFAULT_CHUNK,
    with_entropy: bool = False,
    **forward_kwargs,
):
    """``token_logprobs`` of a packed ``[1, ΣT]`` row, computed by the ring group (every rank passes the
    same row): pad to a multiple of the ring size, run this rank's chunk, gather the whole row's values."""
    chunk = ring_chunk(batch, ring)
    ids = batch["input_ids"]
    targets = torch.roll(ids, -1, dims=1)  # the last one is never used: nothing follows the row
    local_targets = chunk.local(targets)
    head = chunkable_head(model) if chunk_size else None
    kwargs = dict(chunk.model_kwargs(model), use_cache=False, **forward_kwargs)
    if head is None:
        outputs = model(**kwargs)
        logits = outputs.logits[0]
        lp = gather_logprobs(logits, local_targets[0], temperature)
        ent = entropy_from_logits(logits, temperature, chunk_size=1024) if with_entropy else None
    else:
        with _ring_head(head, local_targets[0], temperature, chunk_size, with_entropy) as result:
            outputs = model(**kwargs)
        lp, ent = result
    length = chunk.length
    return _whole_row(lp, ring, length), RingOutputs(
        outputs, _whole_row(ent, ring, length) if ent is not None else None
    )


def _whole_row(local_next: torch.Tensor, ring: ring_attn.RingGroup, length: int) -> torch.Tensor:
    """This chunk's next-token values ``[L]`` → the whole row ``[1, T]`` aligned with ``input_ids``
    (column t scores token t; column 0 is 0)."""
    full = ring_attn.gather_chunks(local_next[None], ring)[:, : length - 1]
    return torch.cat([full.new_zeros(1, 1), full], dim=1)


@contextlib.contextmanager
def _ring_head(head: nn.Linear, targets, temperature, chunk_size, with_entropy):
    """Swap the LM head for one ring forward: it returns chunked log-probs of ``targets`` (the next
    tokens of every local position) in place of logits; yields ``[logprobs, entropy]``, filled by it."""
    result: list = [None, None]

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        logp, ent = chunked_logprobs(
            hidden[0], head.weight, head.bias, targets, temperature, chunk_size, with_entropy
        )
        out, logp, ent = head_values(logp, ent)  # the loss reads views of the output (FSDP2's hook)
        result[:] = [logp, ent]
        return out

    head.forward = forward  # an instance attribute shadows the class's forward for this module only
    try:
        yield result
    finally:
        del head.forward
