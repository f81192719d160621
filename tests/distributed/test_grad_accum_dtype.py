"""``--grad_accum_dtype`` (OpenRLHF's DeepSpeed option) is FSDP2's ``reduce_dtype``: the dtype gradients
are reduced in and accumulated in between the micro-batches of a step. Unset (= fp32) changes nothing;
bf16 rounds them. Checked on the CPU with FSDP2 on a one-process gloo group (the same code path)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tidal.config import DistributedConfig, ModelConfig
from tidal.distributed import World
from tidal.distributed.fsdp import mixed_precision, parallelize, set_gradient_sync, shard_single_device
from tidal.models import load_causal_lm

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("flag", "reduce"), [(None, torch.float32), ("fp32", torch.float32), ("bf16", torch.bfloat16)]
)
def test_policy_reduces_in_the_asked_dtype_and_computes_in_param_dtype(flag, reduce):
    policy = mixed_precision(DistributedConfig(grad_accum_dtype=flag), torch.bfloat16)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, reduce)


def test_unset_or_fp32_with_one_process_leaves_the_model_alone(tiny_llama):
    model = load_causal_lm(ModelConfig(pretrain=str(tiny_llama)), CPU)
    for flag in (None, "fp32"):
        assert parallelize(model, DistributedConfig(grad_accum_dtype=flag), World(), torch.float32) is model
    assert not dist.is_initialized()
    assert all(type(p).__name__ != "DTensor" for p in model.parameters())


def _grads(model, batches, sync_each: bool) -> list[torch.Tensor]:
    """Backward over ``batches`` as one step's micro-batches (reduce on the last only, as the trainers
    do), or each with its own reduce (``sync_each``, zeroing grads between); full float32 gradients."""
    out = []
    for i, ids in enumerate(batches):
        set_gradient_sync(model, sync_each or i == len(batches) - 1)
        model(input_ids=ids, labels=ids).loss.backward()
        if sync_each:
            out.append([p.grad.full_tensor().clone() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
    return out if sync_each else [p.grad.full_tensor() for p in model.parameters()]


def test_bf16_micro_batch_grads_accumulate_in_fp32_or_bf16_as_asked(tiny_llama, own_process_group):
    plain = load_causal_lm(ModelConfig(pretrain=str(tiny_llama)), CPU)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 100, (2, 12), generator=gen) for _ in range(2)]

    def wrapped(flag):  # bf16 compute (--param_dtype bf16), float32 master weights
        mp = mixed_precision(DistributedConfig(grad_accum_dtype=flag), torch.bfloat16)
        return shard_single_device(copy.deepcopy(plain), CPU, mp, reshard_after_forward=True)

    first, second = _grads(wrapped("fp32"), batches, sync_each=True)  # each micro-batch's bf16 grads
    in_fp32 = _grads(wrapped("fp32"), batches, sync_each=False)
    in_bf16 = _grads(wrapped("bf16"), batches, sync_each=False)
    assert all(g.dtype == torch.float32 for g in in_fp32 + in_bf16)  # the sharded grads stay float32
    for a, b, got in zip(first, second, in_fp32, strict=True):
        torch.testing.assert_close(got, a + b, rtol=0, atol=0)
    for a, b, got in zip(first, second, in_bf16, strict=True):
        torch.testing.assert_close(got, (a.bfloat16() + b.bfloat16()).float(), rtol=0, atol=0)
    # the two differ: fp32 accumulation keeps bits a bf16 sum rounds away
    assert any(not torch.equal(a, b) for a, b in zip(in_fp32, in_bf16, strict=True))


def test_grad_accum_dtype_is_a_trainer_flag_not_a_refusal():
    from tidal.cli.train_sft import build_parser

    ns = build_parser().parse_args(["--pretrain", "x", "--dataset", "d", "--grad_accum_dtype", "bf16"])
    assert ns.grad_accum_dtype == "bf16"
