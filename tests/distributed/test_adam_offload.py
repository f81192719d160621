"""``--adam_offload`` with one process: FSDP2's CPU offload on a one-device mesh keeps the weights,
gradients and AdamW state in host memory and AdamW steps there; on the CPU device it changes nothing
and says so. The offload itself is checked on the CPU (gloo, the same FSDP2 code path); the ``gpu``
test checks a whole one-process CUDA run."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
import torch.distributed as dist

from tidal.config import DistributedConfig, ModelConfig, OptimConfig
from tidal.distributed import World
from tidal.distributed.fsdp import offload_single_device, parallelize
from tidal.models import load_causal_lm
from tidal.trainers import common as common_module
from tidal.trainers.optim import build_optimizer

CPU = torch.device("cpu")


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def test_offloaded_model_steps_adamw_on_cpu_state_like_the_plain_model(tiny_llama, own_process_group):
    plain = load_causal_lm(ModelConfig(pretrain=str(tiny_llama)), CPU)
    offloaded = offload_single_device(copy.deepcopy(plain), CPU, torch.float32, reshard_after_forward=True)
    assert dist.is_initialized() and dist.get_world_size() == 1
    weights = [p for p in offloaded.parameters()]
    assert all(type(p).__name__ == "DTensor" and p.device.type == "cpu" for p in weights)

    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    cfg = OptimConfig(learning_rate=1e-3)
    for model in (plain, offloaded):
        optimizer = build_optimizer(model, cfg)
        _loss(model, ids).backward()
        optimizer.step()
        if model is offloaded:
            states = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
            assert states and all(t.device.type == "cpu" for t in states)
    for (name, a), b in zip(plain.named_parameters(), offloaded.parameters(), strict=True):
        torch.testing.assert_close(b.full_tensor(), a.detach(), atol=1e-6, rtol=1e-5, msg=name)


def test_adam_offload_on_the_cpu_device_says_so_and_changes_nothing(tiny_llama, caplog):
    model = load_causal_lm(ModelConfig(pretrain=str(tiny_llama)), CPU)
    with caplog.at_level(logging.INFO, logger="tidal.distributed.fsdp"):
        out = parallelize(model, DistributedConfig(adam_offload=True), World(), torch.float32)
    assert out is model and not dist.is_initialized()
    assert all(type(p).__name__ != "DTensor" for p in model.parameters())
    assert any("--adam_offload: training on the CPU" in r.getMessage() for r in caplog.records)


@pytest.mark.gpu
def test_one_process_cuda_run_keeps_adamw_state_on_cpu(tiny_llama, tmp_path, monkeypatch, own_process_group):
    from tidal.cli.train_sft import parse_run
    from tidal.trainers.sft import run_sft

    data = tmp_path / "sft.jsonl"
    data.write_text(
        "".join(json.dumps({"input": f"{i} + 1 =", "output": f" {i + 1}"}) + "\n" for i in range(8))
    )
    built = []
    build = common_module.build_optimization
    monkeypatch.setattr(
        common_module, "build_optimization", lambda *a, **k: built.append(build(*a, **k)) or built[-1]
    )
    history = run_sft(parse_run([
        "--pretrain", str(tiny_llama), "--dataset", str(data), "--train_batch_size", "4",
        "--micro_train_batch_size", "2", "--max_epochs", "1", "--adam_offload", "--param_dtype", "bf16",
        "--save_path", str(tmp_path / "final"), "--ckpt_path", str(tmp_path / "ckpt"),
    ]))  # fmt: skip
    [opt] = built
    assert opt.precision.device.type == "cuda" and len(history) == 2
    assert all(p.device.type == "cpu" for p in opt.model.parameters())
    states = [t for s in opt.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    assert states and all(t.device.type == "cpu" for t in states)
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
