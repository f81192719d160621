"""``--deepspeed_enable_sleep``'s move of a trained role's state between the device and host memory
(``tidal.distributed.offload.move_state``): the parameters stay the same objects (the optimizer keeps
working on them), values survive the round trip bit for bit, the host buffers are allocated once and
reused at every later sleep, and FSDP2's DTensor parameters stay DTensors. On the CPU both ends are host
memory, which checks the bookkeeping; the ``gpu`` test checks the real move into pinned memory."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from tidal.config import ModelConfig, OptimConfig
from tidal.distributed.fsdp import shard_single_device
from tidal.distributed.offload import HostMirror, move_state
from tidal.models import load_causal_lm
from tidal.trainers.optim import build_optimizer

CPU = torch.device("cpu")


def _train_step(model, optimizer, ids):
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _steps_with_sleeps(model, device, sleeps: bool, mirror: HostMirror, ids) -> None:
    optimizer = build_optimizer(model, OptimConfig(learning_rate=1e-2))
    for _ in range(3):
        _train_step(model, optimizer, ids)
        if sleeps:
            move_state(model, optimizer, mirror, to_host=True)
            move_state(model, optimizer, mirror, to_host=False, device=device)


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def test_sleeping_between_steps_changes_nothing_and_reuses_its_buffers(tiny_llama):
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    plain = load_causal_lm(ModelConfig(pretrain=str(tiny_llama)), CPU)
    slept = copy.deepcopy(plain)
    params = list(slept.parameters())
    mirror = HostMirror(pin=False, device_only=False)
    _steps_with_sleeps(plain, CPU, False, mirror, ids)

    optimizer = build_optimizer(slept, OptimConfig(learning_rate=1e-2))
    _train_step(slept, optimizer, ids)
    move_state(slept, optimizer, mirror, to_host=True)
    first = {key: buf.data_ptr() for key, buf in mirror.buffers.items()}
    assert all(p.data.data_ptr() == mirror.buffers[(id(p), "param")].data_ptr() for p in params)
    assert any(key[1] == "state.exp_avg" for key in first)  # AdamW's moments moved too
    for _ in range(2):
        move_state(slept, optimizer, mirror, to_host=False, device=CPU)
        _train_step(slept, optimizer, ids)
        move_state(slept, optimizer, mirror, to_host=True)
    move_state(slept, optimizer, mirror, to_host=False, device=CPU)
    assert {key: buf.data_ptr() for key, buf in mirror.buffers.items()} == first  # allocated once
    assert list(slept.parameters()) == params and all(
        p is q for p, q in zip(slept.parameters(), params, strict=True)
    )
    for (name, a), b in zip(plain.named_parameters(), slept.parameters(), strict=True):
        assert torch.equal(a.detach(), b.detach()), name


def test_fsdp2_parameters_stay_dtensors_across_a_sleep(tiny_llama, own_process_group):
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    plain = load_causal_lm(ModelConfig(pretrain=str(tiny_llama)), CPU)
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    sharded = shard_single_device(copy.deepcopy(plain), CPU, mp, reshard_after_forward=True)
    _steps_with_sleeps(plain, CPU, False, HostMirror(pin=False, device_only=False), ids)
    _steps_with_sleeps(sharded, CPU, True, HostMirror(pin=False, device_only=False), ids)
    assert all(type(p).__name__ == "DTensor" for p in sharded.parameters())
    for (name, a), b in zip(plain.named_parameters(), sharded.parameters(), strict=True):
        torch.testing.assert_close(_full(b), a.detach(), atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.gpu
def test_cuda_state_sleeps_in_pinned_host_memory_and_comes_back_equal(tiny_llama):
    cuda = torch.device("cuda")
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(2)).to(cuda)
    plain = load_causal_lm(ModelConfig(pretrain=str(tiny_llama)), CPU).to(cuda)
    slept = copy.deepcopy(plain)
    optimizer = build_optimizer(slept, OptimConfig(learning_rate=1e-2))
    _train_step(slept, optimizer, ids)
    before = [p.detach().clone() for p in slept.parameters()]
    mirror = HostMirror(pin=True)
    move_state(slept, optimizer, mirror, to_host=True)
    torch.cuda.synchronize()
    assert all(p.device.type == "cpu" and p.data.is_pinned() for p in slept.parameters())
    states = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    assert states and all(t.device.type == "cpu" and t.is_pinned() for t in states)
    move_state(slept, optimizer, mirror, to_host=False, device=cuda)
    assert all(torch.equal(a, b) for a, b in zip(before, slept.parameters(), strict=True))
    _steps_with_sleeps(plain, cuda, False, mirror, ids)
    for _ in range(2):
        _train_step(slept, optimizer, ids)
        move_state(slept, optimizer, mirror, to_host=True)
        move_state(slept, optimizer, mirror, to_host=False, device=cuda)
    for (name, a), b in zip(plain.named_parameters(), slept.parameters(), strict=True):
        assert torch.equal(a.detach(), b.detach()), name


def test_state_already_in_host_memory_stays_there(tiny_llama):
    """--adam_offload's state lives in host memory: a sleep copies none of it, a wake brings none of it."""
    model = load_causal_lm(ModelConfig(pretrain=str(tiny_llama)), CPU)
    optimizer = build_optimizer(model, OptimConfig(learning_rate=1e-2))
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(3))
    _train_step(model, optimizer, ids)
    pointers = [p.data_ptr() for p in model.parameters()]
    mirror = HostMirror(pin=False)
    move_state(model, optimizer, mirror, to_host=True)
    assert not mirror.buffers and not mirror.moved
    move_state(model, optimizer, mirror, to_host=False, device=CPU)
    assert [p.data_ptr() for p in model.parameters()] == pointers
