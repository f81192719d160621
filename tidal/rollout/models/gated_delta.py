"""The gated delta rule (Gated DeltaNet, Qwen3.5's linear-attention layers) and its causal convolution.

Per value head, a state ``S`` [k_dim, v_dim] is carried along the sequence. For token t, with decay
``g_t`` (log space, <= 0), write strength ``beta_t`` in (0, 1), and l2-normalised ``q_t``, ``k_t``:

    S   <- exp(g_t) * S                       (forget)
    u_t  = beta_t * (v_t - S^T k_t)           (delta rule: write only what S does not already predict)
    S   <- S + k_t u_t^T
    o_t  = S^T (q_t * k_dim ** -0.5)

``recurrent_gated_delta_rule`` runs it token by token (decode: one token per sequence).
``chunk_gated_delta_rule`` gives the same result with matmuls over chunks of C tokens (prefill): inside a
chunk, with the cumulative decay ``G_t = g_1 + ... + g_t`` and the chunk's initial state ``S_0``,

    u_t = beta_t v_t - beta_t e^{G_t} S_0^T k_t - sum_{s<t} beta_t e^{G_t - G_s} (k_t . k_s) u_s

is a unit lower-triangular system ``(I + A) U = B`` solved at once, after which the outputs and the
state at the chunk's end are sums over the chunk. Tokens with ``beta = 0`` and ``g = 0`` leave the state
untouched, which is how right-padded batches keep each sequence's final state.

Both take q/k [batch, T, k_heads, k_dim], v [batch, T, v_heads, v_dim], g/beta [batch, T, v_heads]
(each group of v_heads / k_heads value heads reads one q/k head, as transformers' reference does) and an
optional float32 initial state [batch, v_heads, k_dim, v_dim]; they compute in float32 and return the
output in v's dtype and the final float32 state. These torch versions are the engine's path on every
device and the reference. flash-linear-attention's Triton kernels (``fla_gated_delta_rule``) are opt-in,
``TIDAL_FLA=1`` with the ``fla`` package on CUDA (``fla_usable``): on an H200 (fla 0.6.0, float32) its
recurrent kernel agreed with ``recurrent_gated_delta_rule`` to 1e-8 and its chunked kernel from a zero
state to 3e-4 (TF32), but the chunked kernel started from a non-zero state (a chunked prefill's later
chunks) differed by up to 0.28 in one run, not yet explained, so it is not the default.

The engine's decode steps on CUDA (with Triton, without ``TIDAL_FLA=1``) run tidal's own fused kernel
instead, ``kernels/gated_delta_decode.py``: one launch per layer that reads each state once at its slot
and writes it once (and one for the conv update) (``decode_path``; ``TIDAL_GDN_KERNEL=0`` keeps the torch rule there, to compare).
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache

import torch
import torch.nn.functional as F

from tidal.accel import triton_usable

CHUNK_SIZE = 64
# Opt-in: the engine runs flash-linear-attention's kernels only with TIDAL_FLA=1 (see the docstring).
USE_FLA = os.environ.get("TIDAL_FLA", "0") == "1"
# The fused decode kernel on CUDA is the default; TIDAL_GDN_KERNEL=0 runs the torch rule instead.
USE_DECODE_KERNEL = os.environ.get("TIDAL_GDN_KERNEL", "1") != "0"


@cache
def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def fla_usable(x: torch.Tensor) -> bool:
    """Whether the engine runs flash-linear-attention's Triton kernels on ``x``: switched on
    (``USE_FLA``), CUDA and the ``fla`` package installed."""
    return USE_FLA and x.is_cuda and fla_installed()


def decode_path(x: torch.Tensor) -> str:
    """Which implementation runs a decode step on ``x``'s device: ``"fla"`` (``fla_usable``),
    ``"triton"`` (tidal's fused kernel: CUDA with Triton, the default there) or ``"torch"``."""
    if fla_usable(x):
        return "fla"
    return "triton" if USE_DECODE_KERNEL and triton_usable(x) else "torch"


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (the normalisation of Qwen3.5's q and k)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """float32 [batch, v_heads, T, d] tensors: q/k repeated per value head, l2-normalised, q scaled."""
    groups = v.shape[2] // k.shape[2]
    q, k = repeat_heads(q, groups), repeat_heads(k, groups)
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
    q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    return q, k, v, g.transpose(1, 2).float(), beta.transpose(1, 2).float()


def repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Each head of x [batch, T, heads, d] repeated ``groups`` times in place (``repeat_interleave`` on dim
    2), by an expand: no output size for the device to compute, so CUDA graphs capture it."""
    if groups == 1:
        return x
    batch, length, heads, dim = x.shape
    return (
        x[:, :, :, None].expand(batch, length, heads, groups, dim).reshape(batch, length, heads * groups, dim)
    )


def _initial(state, batch, heads, k_dim, v_dim, device) -> torch.Tensor:
    if state is None:
        return torch.zeros(batch, heads, k_dim, v_dim, dtype=torch.float32, device=device)
    return state.float()


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None):
    """The rule token by token: (output [batch, T, v_heads, v_dim], final state).

    Decode runs it for one token of every sequence, where reading the [k_dim, v_dim] states dominates (at
    batch 256 they outweigh a small model's weights), so each step reads a state as few times as it can:
    ``S^T k`` and ``S^T q`` as matrix products (no [k_dim, v_dim] temporary), the decay folded into the
    prediction (``(e^g S)^T k = e^g S^T k``), the rank-one write added in place."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    state = _initial(initial_state, v.shape[0], v.shape[1], k.shape[-1], v.shape[-1], v.device)
    out = torch.empty_like(v)
    for t in range(v.shape[2]):
        decay = g[:, :, t].exp()[..., None, None]  # [batch, heads, 1, 1]
        k_t = k[:, :, t, None, :]  # [batch, heads, 1, k_dim]
        predicted = (k_t @ state) * decay  # what the decayed state reads at k_t: [batch, heads, 1, v_dim]
        u = beta[:, :, t, None, None] * (v[:, :, t, None, :] - predicted)
        state = (state * decay).addcmul_(k_t.transpose(-1, -2), u)  # a new tensor: the caller's stays
        out[:, :, t] = (q[:, :, t, None, :] @ state)[:, :, 0]
    return out.transpose(1, 2).to(dtype), state


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk_size: int = CHUNK_SIZE):
    """The rule over chunks of ``chunk_size`` tokens: (output [batch, T, v_heads, v_dim], final state)."""
    dtype, length = v.dtype, v.shape[1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    pad = -length % chunk_size  # padded tokens: g = 0, beta = 0, so they change nothing
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    batch, heads, total, k_dim = k.shape
    shape = (batch, heads, total // chunk_size, chunk_size)
    q, k, v = (x.reshape(*shape, -1) for x in (q, k, v))
    g, beta = g.reshape(shape), beta.reshape(shape)
    cum = g.cumsum(-1)  # G_t within each chunk
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).tril()
    # e^{G_t - G_s} for s <= t (0 above the diagonal; masked before exp so it cannot overflow)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    strictly_lower = causal.tril(-1)
    # A: beta_t e^{G_t - G_s} (k_t . k_s) for s < t
    system = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).masked_fill(~strictly_lower, 0.0)
    system = system + torch.eye(chunk_size, dtype=system.dtype, device=system.device)
    rhs_v = beta[..., None] * v  # U = (I + A)^-1 (beta V) - (I + A)^-1 (beta e^G K) S_0
    rhs_k = (beta * cum.exp())[..., None] * k
    solved_v = torch.linalg.solve_triangular(system, rhs_v, upper=False, unitriangular=True)
    solved_k = torch.linalg.solve_triangular(system, rhs_k, upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay  # e^{G_t - G_s} q_t . k_s, s <= t
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]  # e^{G_C - G_s} k_s
    state = _initial(initial_state, batch, heads, k_dim, v.shape[-1], v.device)
    out = torch.empty_like(v)
    for c in range(shape[2]):
        u = solved_v[:, :, c] - solved_k[:, :, c] @ state
        out[:, :, c] = q_decayed[:, :, c] @ state + scores[:, :, c] @ u
        state = state * cum[:, :, c, -1].exp()[..., None, None] + k_to_end[:, :, c].transpose(-1, -2) @ u
    out = out.reshape(batch, heads, total, -1)[:, :, :length]
    return out.transpose(1, 2).to(dtype), state


def fla_gated_delta_rule(q, k, v, g, beta, initial_state=None, recurrent: bool = False):
    """The same through flash-linear-attention's kernels (CUDA; ``fla_usable``). q/k are repeated to the
    value heads first (older releases need equal head counts) and normalised inside the kernel."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent

    groups = v.shape[2] // k.shape[2]
    if groups > 1:
        q, k = repeat_heads(q, groups), repeat_heads(k, groups)
    kernel = fla_recurrent if recurrent else fla_chunk
    init = None if initial_state is None else initial_state.float().contiguous()
    # Keywords: the recurrent kernel's fifth positional parameter is not beta.
    out, state = kernel(
        q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=g.float().contiguous(), beta=beta.contiguous(),
        scale=k.shape[-1] ** -0.5, initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return out.to(v.dtype), state.float()


def gated_delta_rule(q, k, v, g, beta, initial_state=None, recurrent: bool = False):
    """The rule chunked (prefill) or token by token (``recurrent``: one-token decode steps); through fla's
    kernels instead where ``fla_usable``."""
    if fla_usable(v):
        return fla_gated_delta_rule(q, k, v, g, beta, initial_state, recurrent)
    if recurrent:
        return recurrent_gated_delta_rule(q, k, v, g, beta, initial_state)
    return chunk_gated_delta_rule(q, k, v, g, beta, initial_state)


def causal_conv(x: torch.Tensor, history: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal convolution then SiLU: x [batch, channels, T] after ``history`` [batch, channels,
    width - 1] (the inputs before it; zeros at a sequence's start), weight [channels, 1, width]."""
    full = torch.cat((history.to(weight.dtype), x.to(weight.dtype)), dim=-1)
    out = F.conv1d(full, weight, groups=weight.shape[0])
    return F.silu(out).to(x.dtype)
