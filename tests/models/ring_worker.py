"""Ring attention on 2 CPU processes (gloo) against plain attention of the whole row on one; run by
``test_ring_attention.py`` under torchrun. Every rank checks its own chunk and exits non-zero on a
mismatch (the assertion's message names the case)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from tidal.distributed import init_world, shutdown
from tidal.distributed.mesh import ring_group
from tidal.models import ring_attention as ra
from tidal.models.forward import packed_attention_mask, token_logprobs

LENGTHS = [5, 3, 6, 1, 4]  # 19 tokens: uneven segments, a chunk edge inside a segment, one padding token


def reference(q, k, v, segments, window=None):
    """Plain causal attention of the whole row (float32), query heads grouped onto key/value heads."""
    groups = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    mask = packed_attention_mask(segments[None], window=window)[0, 0]
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v


def check_op(ring, window=None, v_dim=8) -> None:
    """``v_dim`` < 8: values narrower than queries/keys, as DeepSeek's MLA (padded inside, cut back)."""
    torch.manual_seed(0)
    hq, hk, d, length = 4, 2, 8, sum(LENGTHS)
    q, k = (torch.randn(h, length, d, requires_grad=True) for h in (hq, hk))
    v = torch.randn(hk, length, v_dim, requires_grad=True)
    weight = torch.randn(hq, length, v_dim)
    segments = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    out = reference(q, k, v, segments, window)
    (out * weight).sum().backward()

    padded = ra.pad_row(segments[None], ring.size, len(LENGTHS))[0]
    layout = ra.RingLayout(ring, padded, padded.numel() // ring.size, window)

    def chunk(t):  # [H, T, D] -> this rank's [H, L, D], a fresh leaf
        t = torch.nn.functional.pad(t.detach(), (0, 0, 0, padded.numel() - length))
        return t[:, ring.rank * layout.chunk : (ring.rank + 1) * layout.chunk].clone().requires_grad_()

    lq, lk, lv = chunk(q), chunk(k), chunk(v)
    local = ra.ring_attention(lq, lk, lv, layout)
    assert local.shape[-1] == v_dim
    full = torch.cat(
        [ra.gather_chunks(local[h][None].flatten(1), ring).view(1, -1, v_dim) for h in range(hq)]
    )
    (full[:, :length] * weight).sum().backward()
    case = f"stride {ring.head_stride} window {window} v_dim {v_dim}"
    rows = slice(ring.rank * layout.chunk, min((ring.rank + 1) * layout.chunk, length))
    n = rows.stop - rows.start
    torch.testing.assert_close(local[:, :n], out[:, rows].detach(), atol=1e-5, rtol=1e-5, msg=case)
    for name, mine, ref in (("dq", lq, q), ("dk", lk, k), ("dv", lv, v)):
        torch.testing.assert_close(
            mine.grad[:, :n], ref.grad[:, rows], atol=1e-5, rtol=1e-5, msg=f"{case} {name}"
        )


def check_model(ring, model_dir: str) -> None:
    """A tiny model's packed log-probs and gradients under ring attention equal the single-process ones."""
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    ids = torch.randint(3, model.config.vocab_size, (1, sum(LENGTHS)))
    batch = {
        "input_ids": ids,
        "position_ids": torch.cat([torch.arange(n) for n in LENGTHS])[None],
        "segment_ids": torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))[None],
    }
    weight = torch.randn(ids.shape)
    for chunk_size in (None, 4):
        for with_entropy in (False, True):
            model.zero_grad()
            ref, ref_out = token_logprobs(model, batch, 0.7, chunk_size, with_entropy)
            loss = (ref * weight).sum() + (ref_out.entropy.sum() if with_entropy else 0)
            loss.backward()
            expected = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad()
            with ra.use_ring(ring):
                lp, out = token_logprobs(model, batch, 0.7, chunk_size, with_entropy)
            loss = (lp * weight).sum() + (out.entropy.sum() if with_entropy else 0)
            loss.backward()
            case = f"model chunk {chunk_size} entropy {with_entropy}"
            torch.testing.assert_close(lp, ref.detach(), atol=1e-5, rtol=1e-5, msg=case)
            if with_entropy:
                torch.testing.assert_close(out.entropy, ref_out.entropy.detach(), atol=1e-5, rtol=1e-5)
            for name, p in model.named_parameters():  # the ring's gradients sum to the whole row's
                grad = p.grad.clone()
                dist.all_reduce(grad, group=ring.group)
                torch.testing.assert_close(grad, expected[name], atol=1e-5, rtol=1e-5, msg=f"{case} {name}")


def check_turns(ring) -> None:
    """Every rank sees every rank's items in the same order; a rank with fewer sits out its missing turns."""
    mine = [f"r{ring.rank}i{i}" for i in range(2 - ring.rank)]  # rank 0 holds 2 items, rank 1 holds 1
    seen = list(ra.turns(mine, ring))
    assert seen == [(ring.rank == 0, "r0i0"), (ring.rank == 1, "r1i0"), (ring.rank == 0, "r0i1")], seen


def main() -> None:
    torch.set_num_threads(1)
    world = init_world()
    for stride in (1, 2):
        ring = ring_group(world, 2, stride)
        check_op(ring)
    check_op(ring, window=3)
    check_op(ring, v_dim=6)
    check_turns(ring)
    check_model(ring_group(world, 2, 1), sys.argv[1])
    shutdown(world)


if __name__ == "__main__":
    main()
