"""The fused gated-delta decode kernel (``tidal/rollout/kernels/gated_delta_decode.py``) run by Triton's
interpreter on the CPU, against ``gated_delta.recurrent_gated_delta_rule`` between an ``index_select`` of the
read slots and an ``index_copy_`` to the write slots (the torch decode path): outputs and states to float32
rounding over chained steps, at Qwen3.5's head shapes (grouped and not) and the tiny test model's, in place
and double buffered, with a padding row on the scratch slot that leaves every other slot bit for bit; the
conv-update kernel against the torch conv step; ``GatedDeltaNet._decode`` through both kernels.
Skipped where triton is missing (CI) or CUDA is present (``tests/rollout/test_qwen3_5_gpu.py`` runs the
compiled kernel there).
"""

from __future__ import annotations

import pytest
import torch

from tests.rollout.triton_interpreter import interpreted
from tidal.rollout.models.gated_delta import causal_conv, recurrent_gated_delta_rule


@pytest.fixture(scope="module")
def kernel():
    with interpreted({"tidal.rollout.kernels.gated_delta_decode": "_decode_kernel"}) as (module,):
        yield module


def step_inputs(rows, k_heads, v_heads, k_dim, v_dim, gen):
    """A step's conv outputs (q | k | v), log decays (<= 0) and write strengths in (0, 1)."""
    mixed = torch.randn(rows, 2 * k_heads * k_dim + v_heads * v_dim, generator=gen)
    g = -torch.rand(rows, v_heads, generator=gen) * 2
    beta = torch.rand(rows, v_heads, generator=gen)
    return mixed, g, beta


def torch_step(mixed, g, beta, state, reads, writes, k_heads, k_dim, v_dim):
    """The torch decode path on a copy of ``state``: (output [rows, v_heads, v_dim], new state)."""
    rows, key = mixed.shape[0], k_heads * k_dim
    q, k, v = mixed.split([key, key, mixed.shape[1] - 2 * key], dim=-1)
    q, k = q.reshape(rows, 1, k_heads, k_dim), k.reshape(rows, 1, k_heads, k_dim)
    v = v.reshape(rows, 1, -1, v_dim)
    out, final = recurrent_gated_delta_rule(q, k, v, g[:, None], beta[:, None], state.index_select(0, reads))
    return out[:, 0], state.clone().index_copy_(0, writes, final)


@pytest.mark.parametrize("mode", ["in_place", "double"])
@pytest.mark.parametrize(
    "k_heads, v_heads, k_dim, v_dim, steps, block_v",
    [(16, 32, 128, 128, 2, 64), (16, 16, 128, 128, 2, 32), (2, 4, 16, 24, 3, 16)],
)
def test_kernel_matches_the_torch_decode_path(kernel, k_heads, v_heads, k_dim, v_dim, steps, block_v, mode):
    gen = torch.Generator().manual_seed(v_heads + v_dim)
    seqs, slots_per_seq = 3, 2 if mode == "double" else 1
    scratch = seqs * slots_per_seq  # the padding rows' slot; one more slot after it stays unused
    state = torch.randn(scratch + 2, v_heads, k_dim, v_dim, generator=gen) * 0.3
    current = torch.arange(seqs) * slots_per_seq
    want = state.clone()
    for _ in range(steps):
        other = current ^ 1 if mode == "double" else current  # double: write the pair's other slot
        reads = torch.cat((current, torch.tensor([scratch]))).to(torch.int32)  # the last row is padding
        writes = torch.cat((other, torch.tensor([scratch]))).to(torch.int32)
        mixed, g, beta = step_inputs(seqs + 1, k_heads, v_heads, k_dim, v_dim, gen)
        before = state.clone()
        out = kernel.gated_delta_decode(mixed, g, beta, state, reads, writes, k_heads, block_v=block_v)
        want_out, want = torch_step(mixed, g, beta, want, reads.long(), writes.long(), k_heads, k_dim, v_dim)
        torch.testing.assert_close(out[:seqs], want_out[:seqs], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state[other], want[other], atol=1e-5, rtol=1e-5)
        untouched = torch.ones(state.shape[0], dtype=torch.bool)
        untouched[other], untouched[scratch] = False, False
        assert torch.equal(state[untouched], before[untouched])  # slots only read, and the spare one
        want[scratch] = state[scratch]  # padding rows race on scratch; its contents are never read
        current = other  # the next step reads what this one wrote


def test_qwen3_5_decode_step_runs_the_kernel_as_the_torch_path(kernel, monkeypatch):
    """``GatedDeltaNet._decode`` through the kernel (as on CUDA) and through the torch rule: the same layer
    outputs and conv/recurrent states, double buffered, for the tiny Qwen3.5's grouped heads."""
    from tidal.rollout.models import qwen3_5
    from tidal.rollout.runner.attention import AttentionMetadata
    from tidal.testing.tiny import tiny_config

    args = qwen3_5.qwen35_args(tiny_config("qwen3_5_text"))
    layer = qwen3_5.GatedDeltaNet(args, layer_idx=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    # The state cache's layout for this one layer: 2 sequences double buffered, the scratch slot 4, a spare.
    conv = torch.randn(1, 6, args.conv_channels, args.conv_width - 1, generator=gen)
    heads, k_dim, v_dim = args.linear_num_v_heads, args.linear_k_dim, args.linear_v_dim
    recurrent = torch.randn(1, 6, heads, k_dim, v_dim, generator=gen)
    x = torch.randn(3, args.hidden_size, generator=gen)  # the last row is padding
    reads, writes = torch.tensor([0, 2, 4]), torch.tensor([1, 3, 4])
    results = {}
    for path in ("torch", "triton"):
        monkeypatch.setattr(qwen3_5, "decode_path", lambda _x, path=path: path)
        states = type("States", (), {"conv": conv.clone(), "recurrent": recurrent.clone()})()
        meta = AttentionMetadata(
            is_prefill=False, slot_mapping=None, states=states, state_slots=reads, state_write_slots=writes
        )
        with torch.no_grad():
            results[path] = (layer(x, None, None, meta), states.conv, states.recurrent)
    for got, want in zip(results["triton"], results["torch"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.equal(results["triton"][2][0, 1], recurrent[0, 1])  # the write slot was written


@pytest.mark.parametrize("mode", ["in_place", "double"])
def test_conv_kernel_matches_the_torch_conv_update(kernel, mode):
    """``causal_conv_decode`` = the torch path's gather, ``causal_conv`` and scatter: outputs and histories
    (at Qwen3.5-0.8B's 6144 channels, width 4, in blocks of 4096: the second one masked), padding row on
    the scratch slot, the slots only read unchanged."""
    gen = torch.Generator().manual_seed(1)
    channels, width, seqs = 6144, 4, 3
    per_seq = 2 if mode == "double" else 1
    scratch = seqs * per_seq
    conv = torch.randn(scratch + 2, channels, width - 1, generator=gen)
    weight = torch.randn(channels, 1, width, generator=gen)
    current = torch.arange(seqs) * per_seq
    for _ in range(2):
        other = current ^ 1 if mode == "double" else current
        reads, writes = (
            torch.cat((current, torch.tensor([scratch]))),
            torch.cat((other, torch.tensor([scratch]))),
        )
        x = torch.randn(seqs + 1, channels + 5, generator=gen)[:, :channels]  # strided rows, as in_proj's
        want_conv = conv.clone()
        window = torch.cat((want_conv.index_select(0, reads), x[:, :, None]), dim=-1)
        want = causal_conv(window[..., -1:], window[..., :-1], weight)[..., 0]
        want_conv.index_copy_(0, writes, window[..., 1:])
        out = kernel.causal_conv_decode(x, conv, weight, reads, writes, block_c=4096)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(conv, want_conv, atol=0, rtol=0)  # histories are copied, not computed
        current = other
