"""Batch-invariant ops: each row's result is a function of that row alone (``--exact_logprobs``).

The rollout engine (flat tokens, paged KV cache, prefill and decode) and the trainer (a transformers model
over packed or padded rows) call these same functions in exact mode, so a token's log-prob is bit-identical
whichever side computes it, whatever else shares its batch, and whether it was a prefill or a decode token.
What makes each one invariant (measured on CPU float32, torch 2.13 / MKL; ``tests/rollout/
test_exact_logprobs.py`` checks every one):

- matmul: torch's CPU GEMM gives a row a different result for 1 row (a GEMV path) than for 2+ rows, so
  ``linear`` pads the rows to a multiple of ``ROW_BLOCK`` and multiplies blocks of exactly that many rows
  (one batched call): every row goes through the same kernel shape. Measured: a row's result does not
  depend on its place in the block, the other rows, or on how many output columns share the call.
- transcendental pointwise ops (exp, log, rsqrt, cos, sin, SiLU): ATen runs a vectorised (SLEEF) loop and
  finishes the tail of a tensor with the scalar libm function, which can differ by an ulp; so the same
  value could round differently in a 1-token decode than in a 100-token prefill. ``pointwise`` runs the op
  on zero-padded blocks of ``POINT_BLOCK`` elements (a multiple of every vector width, below ATen's
  parallel grain), so every element takes the vector path.
- reductions over the last dimension (RMSNorm's mean, the softmax sums) and over a small fixed dimension
  (attention's key block) reduce each output in an order that depends only on the reduced length;
  attention reduces keys in blocks of ``KEY_BLOCK`` at fixed absolute key positions, then adds the block
  sums in block order, so extra (masked, exactly-zero) key blocks beyond a query's position change nothing.
- elementwise mul/add/div are exactly rounded on every path (no fused multiply-add on torch's CPU kernels).

On CUDA (bf16 or fp32) cuBLAS and torch's reduction kernels choose their tiling from the batch's shape, so
``linear``, ``rms_norm``, ``attention`` and ``token_logprobs`` run Triton kernels with one fixed
configuration each (``tidal.rollout.triton_exact``: no split-K, K reduced in fixed blocks, fixed key
blocks from position 0); ``pointwise`` calls the op directly (a CUDA elementwise kernel computes every
element with the same code, so the CPU padding is not needed). The ops are differentiable there (the
trainer's policy loss runs them): the backward recomputes a plain torch formulation, which needs no
invariance. Dtypes: both sides compute in the engine's dtype (``make_exact``'s ``compute_dtype``; bf16 on
CUDA), the weights rounded once to it, with the engine's RoPE frequencies (``use_engine_numerics``), and
autocast must not re-cast inside the ops (``exact_autocast_off``). The CPU ops are invariant in bf16 too
(tested). Where exact mode runs: ``exact_device_problem`` (MoE routing is not covered on CUDA yet).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

ROW_BLOCK = 16  # rows per GEMM call
POINT_BLOCK = 4096  # elements per pointwise call (ATen's parallel grain is 32768)
KEY_BLOCK = 16  # keys reduced together in attention


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` over ``x [..., K]``, with every row computed in a ``ROW_BLOCK``-row GEMM
    (on CUDA: the fixed-tile Triton GEMM). The weight and bias are used in ``x``'s dtype (the compute
    dtype: a trainer's float32 master weights rounded once, as the engine's copy is)."""
    shape = x.shape
    weight = weight.to(x.dtype)
    bias = None if bias is None else bias.to(x.dtype)
    if _on_triton(x):
        rows = x.reshape(-1, shape[-1])
        grad = torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad)
        out = _Linear.apply(rows, weight) if grad else _triton().matmul(rows, weight)
        if bias is not None:
            out = out + bias
        return out.view(*shape[:-1], weight.shape[0])
    rows = x.reshape(-1, shape[-1])
    m = rows.shape[0]
    padded = rows.new_zeros(-(-m // ROW_BLOCK) * ROW_BLOCK, shape[-1])
    padded[:m] = rows
    blocks = padded.view(-1, ROW_BLOCK, shape[-1])
    out = torch.bmm(blocks, weight.t().expand(blocks.shape[0], *weight.t().shape)).view(-1, weight.shape[0])
    out = out[:m]
    if bias is not None:  # a separate add: addmm's fused bias could round differently
        out = out + bias
    return out.view(*shape[:-1], weight.shape[0])


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` (an elementwise op) over ``x``, every element on the vectorised path (see the module doc)."""
    if x.is_cuda:  # every element through the same code already
        return fn(x)
    flat = x.reshape(-1)
    n = flat.numel()
    padded = flat.new_zeros(-(-n // POINT_BLOCK) * POINT_BLOCK)
    padded[:n] = flat
    out = torch.cat([fn(block) for block in padded.split(POINT_BLOCK)])
    return out[:n].view(x.shape)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, scale_in_float32: bool = False
) -> torch.Tensor:
    """Llama's RMSNorm (normalise in float32; scale after rounding to ``x``'s dtype unless
    ``scale_in_float32``), with a row-invariant mean and rsqrt. The weight is used in ``x``'s dtype."""
    weight = weight.to(x.dtype)
    if _on_triton(x):
        return _invariant(
            lambda a, w: _triton().rms_norm(a, w, eps, scale_in_float32),
            lambda a, w: _torch_rms_norm(a, w, eps, scale_in_float32),
            x,
            weight,
        )
    x32 = x.float()
    x32 = x32 * pointwise(torch.rsqrt, x32.pow(2).mean(-1, keepdim=True) + eps)
    if scale_in_float32:
        return (weight * x32).to(x.dtype)
    return weight * x32.to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[*positions.shape, head_dim]`` (rotate-half layout) of integer ``positions``."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device, torch.float32)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (pointwise(torch.cos, emb) * scale).to(dtype), (pointwise(torch.sin, emb) * scale).to(dtype)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of ``q [B, Lq, H, D]`` (at positions ``q_pos [B, Lq]``) over each row's keys
    ``k, v [B, Lk, KV, D]`` at positions ``0..Lk-1``; key ``j`` is seen iff ``j <= q_pos`` (and within the
    sliding ``window``). Scores and softmax in float32; keys beyond a query's position may hold anything
    finite. Returns ``[B, Lq, H, D]`` in ``q``'s dtype."""
    if _on_triton(q):
        return _invariant(
            lambda q_, k_, v_: _triton().attention(q_, k_, v_, q_pos, scale, window),
            lambda q_, k_, v_: _torch_attention(q_, k_, v_, q_pos, scale, window),
            q,
            k,
            v,
        )
    b, lq, h, d = q.shape
    lk = -(-k.shape[1] // KEY_BLOCK) * KEY_BLOCK
    if lk != k.shape[1]:  # pad keys to whole blocks (masked below)
        pad = (0, 0, 0, 0, 0, lk - k.shape[1])
        k, v = torch.nn.functional.pad(k, pad), torch.nn.functional.pad(v, pad)
    groups = h // k.shape[2]
    k = k.float().repeat_interleave(groups, dim=2)  # [B, Lk, H, D]
    v = v.float().repeat_interleave(groups, dim=2)
    scores = (q.float()[:, :, None] * k[:, None]).sum(-1) * scale  # [B, Lq, Lk, H]
    j = torch.arange(lk, device=q.device)
    seen = j[None, None, :] <= q_pos[:, :, None]
    if window is not None:
        seen &= j[None, None, :] > q_pos[:, :, None] - window
    scores = scores.masked_fill(~seen[..., None], float("-inf"))
    top = scores.amax(dim=2, keepdim=True)  # a max is exact in any order
    p = pointwise(torch.exp, scores - top)  # [B, Lq, Lk, H]
    nb = lk // KEY_BLOCK
    p_blocks = p.view(b, lq, nb, KEY_BLOCK, h)
    denom_blocks = p_blocks.sum(3)  # [B, Lq, nb, H]
    out_blocks = (p_blocks[..., None] * v.view(b, 1, nb, KEY_BLOCK, h, d)).sum(3)  # [B, Lq, nb, H, D]
    denom, out = denom_blocks[:, :, 0], out_blocks[:, :, 0]
    for i in range(1, nb):  # block order: trailing all-masked blocks add exact zeros
        denom = denom + denom_blocks[:, :, i]
        out = out + out_blocks[:, :, i]
    return (out / denom[..., None]).to(q.dtype)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float | torch.Tensor = 1.0
) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` at ``tokens`` (float32), each row reduced on its own.
    ``temperature``: a number, or a tensor broadcasting against ``logits[..., :1]``."""
    if _on_triton(logits):
        temp = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device)
        if torch.is_grad_enabled() and logits.requires_grad:
            return _TokenLogprobs.apply(logits, tokens, temp)
        return _triton().token_logprobs(logits, tokens, temp)
    z = logits.float()
    temp = torch.as_tensor(temperature, dtype=torch.float32, device=z.device)
    z = z / (temp if temp.dim() == 0 else temp[..., None])
    top = z.amax(-1, keepdim=True)
    total = pointwise(torch.exp, z - top).sum(-1, keepdim=True)
    lse = top + pointwise(torch.log, total)
    return (z.gather(-1, tokens[..., None]) - lse).squeeze(-1)


# ---------------------------------------------------------------- CUDA: Triton forward, torch backward
def _on_triton(x: torch.Tensor) -> bool:
    """Whether ``x``'s op runs the Triton kernels (CUDA); the interpreter tests switch CPU tensors over."""
    return x.is_cuda


def _triton():
    from tidal.rollout import triton_exact  # Triton is imported only where a kernel runs

    return triton_exact


class _Recompute(torch.autograd.Function):
    """``fast(*tensors)`` forward; the gradient of ``reference(*tensors)`` (recomputed) backward."""

    @staticmethod
    def forward(ctx, fast, reference, *tensors):
        ctx.reference = reference
        ctx.save_for_backward(*tensors)
        return fast(*tensors)

    @staticmethod
    def backward(ctx, grad):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        wanted = [t for t in inputs if t.requires_grad]
        with torch.enable_grad():
            out = ctx.reference(*inputs)
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
        return None, None, *(next(grads) if t.requires_grad else None for t in inputs)


def _invariant(fast: Callable, reference: Callable, *tensors: torch.Tensor) -> torch.Tensor:
    """``fast(*tensors)`` (a batch-invariant kernel), differentiable through ``reference`` (the same
    function in plain torch) when a gradient is wanted."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _Recompute.apply(fast, reference, *tensors)
    return fast(*tensors)


def _torch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, scale_in_float32: bool
) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if scale_in_float32:
        return (weight.float() * x32).to(x.dtype)
    return weight * x32.to(x.dtype)


def _torch_attention(q, k, v, q_pos, scale: float, window: int | None) -> torch.Tensor:
    j = torch.arange(k.shape[1], device=q.device)
    seen = j[None, None, :] <= q_pos[:, :, None]
    if window is not None:
        seen &= j[None, None, :] > q_pos[:, :, None] - window
    # KV heads repeated rather than ``enable_gqa`` (which not every masked SDPA kernel takes), so a masked
    # memory-efficient kernel can run: the math backend's [B, H, Lq, Lk] scores are large for long rows.
    groups = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(groups, dim=2).transpose(1, 2) for t in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=seen[:, None], scale=scale)
    return out.transpose(1, 2)


class _Linear(torch.autograd.Function):
    """The GEMM kernel; its gradients ``grad @ w`` and ``grad^T @ x`` (torch's GEMMs: no forward to redo)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return _triton().matmul(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad.t() @ x if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


class _TokenLogprobs(torch.autograd.Function):
    """The log-prob kernel, with the gradient ``(onehot(token) - softmax(z)) / T`` computed over chunks of
    rows: a trainer's micro-batch has ~20k rows of a 152k vocabulary, whose float32 softmax at once
    would take ~12 GB per temporary."""

    CHUNK = 2048  # rows per backward chunk

    @staticmethod
    def forward(ctx, logits, tokens, temp):
        ctx.save_for_backward(logits, tokens, temp)
        return _triton().token_logprobs(logits, tokens, temp)

    @staticmethod
    def backward(ctx, grad):
        logits, tokens, temp = ctx.saved_tensors
        lead, vocab = logits.shape[:-1], logits.shape[-1]
        rows = logits.reshape(-1, vocab)
        toks = tokens.expand(lead).reshape(-1, 1)
        scale = (grad.float() / temp.expand(lead)).reshape(-1, 1)
        out = torch.empty_like(rows)
        for start in range(0, rows.shape[0], _TokenLogprobs.CHUNK):
            part = slice(start, start + _TokenLogprobs.CHUNK)
            temps = temp.expand(lead).reshape(-1, 1)[part]
            d = torch.softmax(rows[part].float() / temps, -1).mul_(-scale[part])
            out[part] = d.scatter_add_(1, toks[part], scale[part]).to(out.dtype)
        return out.view(logits.shape), None, None


def exact_autocast_off(device: torch.device):
    """A context in which autocast leaves an exact-mode forward's dtypes alone (they are the engine's)."""
    if device.type in ("cuda", "cpu"):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


# The families measured exact on CUDA (an H200, bf16): the dense ones, and the MoE ones since their routing
# sums by halving and picks by a stable sort (``moe_route``; tests/rollout/test_exact_logprobs.py, gpu).
EXACT_CUDA_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe")


def exact_device_problem(
    device: torch.device, dtype: torch.dtype, model_type: str | None = None
) -> str | None:
    """Why exact mode cannot run a ``model_type`` model on ``device`` in ``dtype`` (None: it can): CPU
    float32 or bfloat16 (the torch ops above: bfloat16 measured invariant as float32 is), CUDA bfloat16 or
    float32 with Triton, dense families only."""
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        return None
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float32):
        from tidal.accel import triton_available

        if model_type is not None and model_type not in EXACT_CUDA_MODEL_TYPES:
            return f"exact_logprobs on CUDA supports the {', '.join(EXACT_CUDA_MODEL_TYPES)} families, not {model_type!r}"
        return None if triton_available() else "exact_logprobs on CUDA needs Triton installed"
    return f"exact_logprobs runs in float32 or bfloat16 on the CPU or CUDA, not {device.type} {dtype}"


def engine_dtype(device: torch.device) -> torch.dtype:
    """The RL rollout engine's dtype on ``device`` (its ``auto``: bfloat16 on CUDA, float32 on CPU)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def use_engine_numerics(model: torch.nn.Module, dtype: torch.dtype | None = None) -> None:
    """Make an exact-mode transformers model compute what the engine computes:

    - in ``dtype`` (default: ``engine_dtype`` of its device): the embedding output is cast to it, so the
      residual stream is in it, and the ops take the (e.g. float32 master) weights rounded to it; with
      autocast off around the forward (``exact_autocast_off``) nothing re-casts in between;
    - with the engine's RoPE frequencies (``rope.inv_freq_and_scale`` on the CPU, as the engine builds
      them): transformers computes its ``inv_freq`` with ``pow`` on the device the model is built on, and
      CUDA's ``pow`` can round differently from the CPU's."""
    from tidal.rollout.models.rope import inv_freq_and_scale

    if dtype is None:
        dtype = engine_dtype(next(model.parameters()).device)
    embed = model.get_input_embeddings()
    if getattr(embed, "tidal_compute_hook", None) is not None:
        embed.tidal_compute_hook.remove()
    embed.tidal_compute_hook = embed.register_forward_hook(lambda module, args, out: out.to(dtype))
    model.tidal_compute_dtype = dtype
    config = model.config
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "inv_freq"):
            with torch.device("cpu"):
                inv_freq, _ = inv_freq_and_scale(
                    config, 2 * module.inv_freq.numel(), config.max_position_embeddings
                )
            with torch.no_grad():
                module.inv_freq.copy_(inv_freq)


def segment_layout(position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows ``[B, T]`` of one or more samples each (positions restart at 0 per sample, as in packed
    rows): ``(index [S, L], valid [S, L], local [S, L])`` — the flat token index of each sample's ``l``-th
    token, whether it exists, and its position within the sample. A sample starts wherever the position
    does not continue the previous token's (a row start, a 0, or a padding token)."""
    bsz, t = position_ids.shape
    flat = position_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1] + 1
    starts[::t] = True
    first = torch.nonzero(starts).view(-1)
    lengths = torch.diff(torch.cat([first, first.new_tensor([flat.numel()])]))
    cols = torch.arange(int(lengths.max()), device=flat.device)
    valid = cols[None, :] < lengths[:, None]
    index = torch.where(valid, first[:, None] + cols[None, :], 0)
    return index, valid, cols[None, :].expand_as(index)


# ---------------------------------------------------------------- a transformers model in exact mode
EXACT_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral")
EXACT_ATTENTION = "tidal_exact"


def exact_problem(config, lora_dropout: float = 0.0, load_in_4bit: bool = False) -> str | None:
    """Why a model of this HF config (or ``DecoderArgs``) cannot run in exact mode (None: it can). LoRA
    adapters run merged (``tidal.models.exact_lora``), which dropout on their input would break."""
    model_type = getattr(config, "model_type", None)
    if model_type not in EXACT_MODEL_TYPES:
        return f"--exact_logprobs supports the {', '.join(EXACT_MODEL_TYPES)} families, not {model_type!r}"
    if getattr(config, "router_jitter_noise", 0):  # Mixtral's training-time noise on the router's input
        return "--exact_logprobs needs router_jitter_noise 0 (the engine's router has no noise)"
    if lora_dropout:
        return "--exact_logprobs runs LoRA adapters merged, which needs --lora_dropout 0"
    if load_in_4bit:  # the engine holds dequantized weights; the 4-bit matmul is not batch-invariant
        return "--exact_logprobs does not support a 4-bit base (--load_in_4bit)"
    return None


def hf_exact_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention (``query [B, H, T, D]``, ``key/value [B, KV, T, D]``) through ``attention``:
    each sample of a row (found from ``position_ids``; the mask is not read) attends its own tokens."""
    position_ids = kwargs.get("position_ids")
    b, h, t, d = query.shape
    if position_ids is None:
        position_ids = torch.arange(t, device=query.device).expand(b, t)
    index, valid, local = segment_layout(position_ids)
    q, k, v = (x.transpose(1, 2).reshape(b * t, x.shape[1], d)[index] for x in (query, key, value))
    window = getattr(module, "tidal_window", None)
    out = attention(q, k, v, local, scaling if scaling is not None else d**-0.5, window)
    flat = out.new_zeros(b * t, h, d)
    flat[index[valid]] = out[valid]
    return flat.view(b, t, h, d), None


def make_exact(model: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Switch a transformers model of a supported family to the batch-invariant ops, in place: every
    ``nn.Linear`` (LM head included), RMSNorm, the MLP's activation, RoPE and attention, computing in
    ``compute_dtype`` (``use_engine_numerics``). Returns it."""
    from transformers import AttentionInterface

    from tidal.rollout.models.architecture import ACTIVATIONS, sliding_windows

    config = model.config
    problem = exact_problem(config)
    if problem:
        raise ValueError(problem)
    AttentionInterface.register(EXACT_ATTENTION, hf_exact_attention)
    windows = sliding_windows(config)
    act = ACTIVATIONS[config.hidden_act]
    weights_dtype = torch.float32 if config.model_type == "mixtral" else None  # see moe_route
    for module in model.modules():
        name = type(module).__name__
        if isinstance(module, torch.nn.Linear):
            module.forward = bound_forward(lambda m, x: linear(x, m.weight, m.bias), module)
        elif name.endswith("RMSNorm"):
            module.forward = bound_forward(lambda m, x: rms_norm(x, m.weight, m.variance_epsilon), module)
        elif name.endswith("RotaryEmbedding"):
            module.forward = bound_forward(
                lambda m, x, position_ids: rope_cos_sin(
                    position_ids, m.inv_freq, m.attention_scaling, x.dtype
                ),
                module,
            )
        elif name.endswith("TopKRouter"):  # MoE: routing, experts and the shared expert (moe_route, ...)
            module.forward = bound_forward(
                lambda m, x: moe_route(
                    x, m.weight, m.top_k, getattr(m, "norm_topk_prob", True), weights_dtype
                ),
                module,
            )
        elif name.endswith("Experts") and hasattr(module, "gate_up_proj"):
            module.forward = bound_forward(
                lambda m, x, ids, weights: moe_experts(x, m.gate_up_proj, m.down_proj, ids, weights, act),
                module,
            )
        elif hasattr(module, "shared_expert_gate"):
            module.forward = bound_forward(hf_exact_shared_moe, module)
        elif all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj")):
            module.forward = bound_forward(
                lambda m, x: m.down_proj(pointwise(act, m.gate_proj(x)) * m.up_proj(x)), module
            )
        elif hasattr(module, "layer_idx") and hasattr(module, "o_proj"):
            module.tidal_window = windows[module.layer_idx]
    for cfg in {
        id(c): c for c in (config, getattr(getattr(model, "model", None), "config", config))
    }.values():
        cfg._attn_implementation = EXACT_ATTENTION
    use_engine_numerics(model, compute_dtype)
    model.tidal_exact = True
    return model


def is_exact(model: torch.nn.Module) -> bool:
    """Whether ``make_exact`` switched this model (or the model it wraps)."""
    return bool(getattr(model, "tidal_exact", False))


def bound_forward(fn, module):
    """``fn`` with ``module`` as its first argument (an instance ``forward`` that shadows the class's)."""

    def forward(*args, **kwargs):
        return fn(module, *args, **kwargs)

    return forward


# ---------------------------------------------------------------- mixture of experts (both sides)
def moe_route(
    x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A top-k router over ``x [T, H]``: ``(logits, weights [T, k], expert ids [T, k])``. Softmax in float32,
    the k most probable experts (ties to the lower id: a stable sort, not ``topk``, whose CUDA algorithm
    depends on the shape), optional renormalisation over the k; sums by ``tree_sum`` (the same order on
    every device and batch). The weights are rounded to ``weights_dtype`` (None: the logits' dtype, as Qwen
    routers do; Mixtral's stay float32)."""
    logits = linear(x.reshape(-1, x.shape[-1]), weight)
    z = logits.float()
    p = pointwise(torch.exp, z - z.amax(-1, keepdim=True))
    probs, order = torch.sort(p / tree_sum(p), dim=-1, descending=True, stable=True)
    weights, ids = probs[:, :top_k], order[:, :top_k]
    if renormalize:
        weights = weights / tree_sum(weights)
    return logits, weights.to(weights_dtype or logits.dtype), ids


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension (kept, size 1) by halving: zero-padded to a power of two, then the two
    halves added until one column is left. Only elementwise adds, in an order fixed by the length alone
    (torch's CUDA reductions pick their order from the whole tensor's shape)."""
    width = 1 << (x.shape[-1] - 1).bit_length()
    if width != x.shape[-1]:
        x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def moe_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for ``x [T, H]`` (stacked experts: ``gate_up_proj``
    [E, 2I, H], gate rows first; ``down_proj`` [E, H, I]). Each expert multiplies its (token, slot) pairs
    in row-invariant GEMMs; the k weighted outputs are then added in slot order (slot 0 + slot 1 + ...),
    so a token's sum never depends on which other tokens share its experts."""
    t, k = ids.shape
    flat, flat_weights = ids.reshape(-1), weights.reshape(-1)
    pairs, outputs = [], []
    for expert in torch.unique(flat).tolist():
        rows = torch.nonzero(flat == expert).view(-1)
        gate, up = linear(x[rows // k], gate_up_proj[expert]).chunk(2, dim=-1)
        out = linear(pointwise(act, gate) * up, down_proj[expert])
        pairs.append(rows)
        outputs.append(out * flat_weights[rows, None])
    values = torch.cat(outputs)
    slots = values.new_zeros(t * k, x.shape[-1]).index_put((torch.cat(pairs),), values).view(t, k, -1)
    total = slots[:, 0]
    for slot in range(1, k):
        total = total + slots[:, slot]
    return total.to(x.dtype)


def shared_expert_mix(routed: torch.Tensor, gate_logit: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """Qwen2-MoE's output: the routed experts' plus ``sigmoid(gate) * shared expert`` (row-invariant)."""
    return routed + pointwise(torch.sigmoid, gate_logit) * shared


def gate_column(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``linear`` with a one-output weight ``[1, H]`` (Qwen2-MoE's shared-expert gate): run as a
    ``ROW_BLOCK``-column product (zero rows added), since torch's CPU GEMM takes a row-dependent path
    (measured) when the product has a single output column."""
    padded = torch.cat([weight, weight.new_zeros(ROW_BLOCK - 1, weight.shape[-1])])
    return linear(x, padded)[..., :1]


def hf_exact_shared_moe(block, hidden_states: torch.Tensor) -> torch.Tensor:
    """A transformers Qwen2-MoE block (router, experts, gated shared expert) through the exact ops."""
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    _, weights, ids = block.gate(x)
    routed = block.experts(x, ids, weights)
    gate_logit = gate_column(x, block.shared_expert_gate.weight)
    return shared_expert_mix(routed, gate_logit, block.shared_expert(x)).view(shape)
