"""Per-token log-probs (and entropy) without the ``[tokens, vocab]`` float32 logits of a whole micro-batch.

With a 150k vocabulary the logits dwarf every other activation: 16k tokens × 152k × 4 bytes is 10 GB
in float32, kept for backward. Here the LM head runs in chunks of ``chunk_size`` positions: each chunk
projects its hidden states, takes ``log_softmax`` at the target tokens in float32 and is discarded.
Under autograd a chunk saves only its hidden-state slice and logsumexp; backward recomputes the chunk's
logits (one extra head matmul), so at most one chunk's logits exist at a time, forward or backward.
On CUDA the float32 passes over a chunk's logits run as Triton kernels (``triton_logprobs``).

``head_logprobs`` swaps the LM head's ``forward`` for the duration of one model call, so the model's
own forward (and any FSDP2 / peft wrapping around it) runs unchanged and only the head's output
changes: ``[B, T]`` log-probs instead of ``[B, T, V]`` logits.

Everything the loss reads from a swapped head must be (a view of) the head's return value
(``head_values``). FSDP2 frees the gathered weights after forward under ``--zero_stage 3`` and gathers
them again for backward in a hook on the sharded module's *outputs*: a log-prob or entropy tensor
handed to the loss on the side would reach the head's backward with its weight's storage freed.

The token log-probs of SFT, DPO, KTO and PPO always take this path. Losses that need more of the
vocabulary than the target token (KD's distributions, PRM's reward tokens at step markers) read full
logits unless ``--use_liger_kernel`` (OpenRLHF's switch for its fused kernels) asks for their fused
head: ``head_output`` lets such a loss apply the head itself, on the positions and rows it needs or
chunk by chunk (``chunked_rows``), inside the model's forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tidal.accel import triton_usable
from tidal.algorithms.logprobs import entropy_from_logits, gather_logprobs
from tidal.rollout.models.registry import chunkable_model_types

DEFAULT_CHUNK = 2048
# Families whose causal-LM forward applies nothing after ``lm_head`` (no soft-capping or logit scaling),
# so replacing the head's output is exact: the engine's families that say so in its registry.
CHUNKABLE_MODEL_TYPES = chunkable_model_types()


def chunkable_head(model: nn.Module) -> nn.Linear | None:
    """The plain ``nn.Linear`` LM head of a supported family, or None (then use full logits)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in CHUNKABLE_MODEL_TYPES:
        return None
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    # A LoRA- or quantisation-wrapped head has other weights: leave it to its own forward. (FSDP2 would
    # give a separately sharded head a generated subclass named FSDP<cls>.)
    plain = type(head) is nn.Linear or (isinstance(head, nn.Linear) and type(head).__name__ == "FSDPLinear")
    return head if plain else None


def _chunk_logprobs(h: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float):
    z = nn.functional.linear(h, weight, bias)
    if triton_usable(z):
        from tidal.models.triton_logprobs import logprobs_lse

        return logprobs_lse(z, targets, temperature)[0]
    return gather_logprobs(z, targets, temperature)


def _chunk_logprobs_entropy(h, weight, bias, targets, temperature: float):
    z = nn.functional.linear(h, weight, bias)
    return gather_logprobs(z, targets, temperature), entropy_from_logits(z, temperature)


def _upcast(z: Tensor) -> Tensor:
    """Float32 (float64 stays float64, for gradcheck); always a fresh tensor, safe to modify in place."""
    return z.to(torch.promote_types(z.dtype, torch.float32), copy=True)


class _ChunkLogprobs(torch.autograd.Function):
    """One chunk's ``log softmax(h @ W.T + b)[targets]`` that saves only ``h``, the targets and the
    logsumexp: backward recomputes the chunk's logits and writes the softmax gradient in place
    (``g·(onehot − p)/T``), a few passes over ``[chunk, V]`` where autograd through a checkpoint
    takes about twice as many. Matmuls run under the forward's autocast state."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, temperature):
        device = h.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        z = nn.functional.linear(h, weight, bias)
        if triton_usable(z):
            from tidal.models.triton_logprobs import logprobs_lse

            logp, lse = logprobs_lse(z, targets, temperature)
        else:
            z = _upcast(z)
            if temperature != 1.0:
                z.div_(temperature)
            lse = torch.logsumexp(z, dim=-1)
            logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
        del z
        ctx.save_for_backward(h, weight, bias, targets, lse)
        ctx.temperature = temperature
        return logp

    @staticmethod
    def backward(ctx, grad):
        h, weight, bias, targets, lse = ctx.saved_tensors
        _check_gathered(weight)
        device, dtype, enabled = ctx.autocast
        with torch.autocast(device_type=device, dtype=dtype, enabled=enabled):
            z = nn.functional.linear(h, weight, bias)
        if triton_usable(z):
            from tidal.models.triton_logprobs import softmax_grad_

            grad_z = softmax_grad_(z.contiguous(), targets, lse, grad.float(), ctx.temperature)
        else:
            grad_z = _softmax_grad(z, targets, lse, grad, ctx.temperature)
        del z
        with torch.autocast(device_type=device, dtype=dtype, enabled=enabled):
            grad_h = grad_z @ weight if ctx.needs_input_grad[0] else None
            grad_w = grad_z.t() @ h if ctx.needs_input_grad[1] else None
        grad_b = grad_z.float().sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return (
            None if grad_h is None else grad_h.to(h.dtype),
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
        )


def _check_gathered(weight: Tensor) -> None:
    """One clear error for a head weight FSDP2 did not gather again before backward (its storage freed
    after forward), instead of a failing matmul: the loss read the head's values around its output."""
    plain = type(weight) in (Tensor, nn.Parameter)  # a tensor subclass may have no storage of its own
    if plain and weight.numel() and weight.untyped_storage().nbytes() == 0:
        raise RuntimeError(
            "the LM head's weight was freed (FSDP2 resharded it after forward) and not gathered again for "
            "backward: the loss must read the log-probs from the head's output (logprob_head.head_values)"
        )


def _softmax_grad(z: Tensor, targets: Tensor, lse: Tensor, grad: Tensor, temperature: float) -> Tensor:
    """``g·(onehot − softmax(z / T)) / T`` in ``z``'s dtype, through float32 (the torch path)."""
    p = _upcast(z)
    if temperature != 1.0:
        p.div_(temperature)
    p.sub_(lse[:, None]).exp_().mul_(-grad[:, None])  # −g·softmax
    p.scatter_add_(-1, targets[:, None], grad[:, None])  # + g at the target
    if temperature != 1.0:
        p.div_(temperature)
    return p.to(z.dtype)


def chunked_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``log softmax(hidden @ weight.T + bias)[targets]`` over ``[N, H]`` hidden states, chunk by chunk.

    Returns ``(logprobs [N], entropy [N] or None)`` in float32. Under autograd each chunk saves only
    its inputs (``_ChunkLogprobs``, or a checkpoint with entropy), so backward also holds one chunk's
    logits at a time.
    """
    fn = _chunk_logprobs_entropy if with_entropy else _chunk_logprobs
    recording = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    logps, ents = [], []
    for h, t in zip(hidden.split(chunk_size), targets.split(chunk_size), strict=True):
        if recording and not with_entropy:
            out = _ChunkLogprobs.apply(h, weight, bias, t, temperature)
        elif recording:  # entropy's gradient too: let autograd derive it, recomputing the chunk
            out = checkpoint(fn, h, weight, bias, t, temperature, use_reentrant=False)
        else:
            out = fn(h, weight, bias, t, temperature)
        if with_entropy:
            logps.append(out[0])
            ents.append(out[1])
        else:
            logps.append(out)
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)


def head_values(logprobs: Tensor, entropy: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(output, logprobs, entropy)``: what a swapped head returns — the log-probs, stacked with the
    entropy when there is one — and the two as views of it, for the loss. Through the views every gradient
    reaches the head's output, where FSDP2's pre-backward hook gathers the weights the head's backward
    reads (see the module docstring). ``logprobs`` is fresh (a ``cat``), not a view: FSDP2 mishandles
    in-place ops on a view output."""
    if entropy is None:
        return logprobs, logprobs, None
    out = torch.stack([logprobs, entropy])
    return out, out[0], out[1]


@dataclass
class HeadResult:
    """What the swapped head computed during one forward, aligned with ``input_ids`` (``[B, T]``)."""

    logprobs: Tensor | None = None
    entropy: Tensor | None = None
    hidden: Tensor | None = field(default=None, repr=False)


def _aligned(values: Tensor, batch_size: int) -> Tensor:
    """``[B·(T−1)]`` next-token values → ``[B, T]`` with a 0 in column 0 (nothing predicts token 0)."""
    values = values.view(batch_size, -1)
    return torch.cat([values.new_zeros(batch_size, 1), values], dim=1)


# The per-token values of a swapped head: ``(flat hidden [N, H], targets [N]) -> (logprobs [N], entropy
# [N] or None)``; the default is ``chunked_logprobs`` with the head's weights, exact mode passes its own.
TokenValues = Callable[[Tensor, Tensor], tuple[Tensor, Tensor | None]]


@contextlib.contextmanager
def head_logprobs(
    head: nn.Linear,
    input_ids: Tensor,
    temperature: float,
    chunk_size: int,
    with_entropy: bool,
    token_values: TokenValues | None = None,
):
    """Within the context, ``head(hidden)`` computes chunked log-probs of ``input_ids`` (filled into the
    yielded ``HeadResult``) and returns them in place of logits; ``token_values`` replaces the default
    per-chunk computation (``chunked_logprobs`` over the head's weight and bias)."""
    result = HeadResult()

    def default_values(flat: Tensor, targets: Tensor) -> tuple[Tensor, Tensor | None]:
        return chunked_logprobs(flat, head.weight, head.bias, targets, temperature, chunk_size, with_entropy)

    values = token_values or default_values

    def forward(hidden: Tensor) -> Tensor:
        b, _, width = hidden.shape
        logp, ent = values(hidden[:, :-1].reshape(-1, width), input_ids[:, 1:].reshape(-1))
        result.hidden = hidden
        out, result.logprobs, result.entropy = head_values(
            _aligned(logp, b), _aligned(ent, b) if ent is not None else None
        )
        return out

    with head_output(head, forward):
        yield result


class LogprobOutputs:
    """The model's outputs with ``logits`` computed on first access (full ``[B, T, V]``, as before) and
    ``entropy`` when it was asked for; every other attribute is the model's (e.g. ``aux_loss``)."""

    def __init__(self, outputs, head: nn.Linear, result: HeadResult):
        self._outputs, self._head, self._result = outputs, head, result
        device = result.hidden.device.type
        # Recompute lazy logits under the autocast state of the original forward.
        self._autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        self._logits: Tensor | None = None

    @property
    def entropy(self) -> Tensor | None:
        return self._result.entropy

    @property
    def logits(self) -> Tensor:
        if self._logits is None:
            device, dtype, enabled = self._autocast
            with torch.autocast(device_type=device, dtype=dtype, enabled=enabled):
                self._logits = self._head(self._result.hidden)
        return self._logits

    def __getattr__(self, name: str):
        return getattr(self._outputs, name)

    def __getitem__(self, key):
        return self.logits if key == "logits" else self._outputs[key]


@contextlib.contextmanager
def head_output(head: nn.Linear, fn: Callable[[Tensor], Tensor]):
    """Within the context, ``head(hidden)`` returns ``fn(hidden)`` (``[B, T, H]`` hidden states in)
    instead of ``[B, T, V]`` logits, so the model's ``logits`` output is whatever the loss computed from
    the head's input; ``fn`` runs inside the model's forward, where FSDP2 has the head's weights. A forward
    the head already had as an instance attribute (exact mode's batch-invariant head) is put back after."""
    saved = head.__dict__.get("forward")
    head.forward = fn  # an instance attribute shadows the class's forward for this module only
    try:
        yield
    finally:
        if saved is None:
            del head.forward
        else:
            head.forward = saved


def chunked_rows(fn: Callable[..., tuple[Tensor, ...]], chunk_size: int, *rows: Tensor) -> tuple[Tensor, ...]:
    """``fn`` over chunks of ``chunk_size`` rows of ``rows`` (split along dim 0), outputs concatenated.
    Under autograd each chunk runs in a non-reentrant checkpoint, so backward recomputes it and at most
    one chunk's intermediates (e.g. its ``[chunk, V]`` logits) exist at a time."""
    recording = torch.is_grad_enabled() and any(r.requires_grad for r in rows)
    outs = []
    for chunk in zip(*(r.split(chunk_size) for r in rows), strict=True):
        outs.append(checkpoint(fn, *chunk, use_reentrant=False) if recording else fn(*chunk))
    return tuple(torch.cat(parts) for parts in zip(*outs, strict=True))
