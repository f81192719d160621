"""LoRA's frozen base under bf16 compute (``tidal.models.loading.store_frozen_linears``): its ``nn.Linear``
weights are stored in bf16 (embeddings, norms and the adapters stay float32), and a forward and backward
under bf16 autocast give the same bits as with the float32 base, since autocast casts those weights anyway."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tidal.config import ModelConfig
from tidal.models import load_causal_lm
from tidal.models.loading import store_frozen_linears
from tidal.models.precision import Precision

CPU = torch.device("cpu")


def lora_model(folder, param_dtype: str) -> nn.Module:
    cfg = ModelConfig(pretrain=str(folder), param_dtype=param_dtype, lora_rank=4, lora_alpha=8)
    torch.manual_seed(0)  # the same adapters for both loads
    model = load_causal_lm(cfg, CPU)
    with torch.no_grad():  # a non-zero lora_B, so the adapters take part in the forward
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.linspace(-0.05, 0.05, p.numel()).reshape(p.shape))
    return model


def test_frozen_linears_in_bf16_give_the_same_forward_and_grads(tiny_llama):
    bf16 = lora_model(tiny_llama, "bf16")
    fp32 = lora_model(tiny_llama, "fp32")  # float32 compute: nothing is cast at load
    dtypes = {name: p.dtype for name, p in bf16.named_parameters()}
    linears = [n for n in dtypes if "base_layer" in n or "lm_head" in n]
    assert linears and all(dtypes[n] == torch.bfloat16 for n in linears)
    rest = [n for n in dtypes if n not in linears]
    assert (
        any("lora_A" in n for n in rest)
        and any("embed_tokens" in n for n in rest)
        and any("norm" in n for n in rest)
    )
    assert all(dtypes[n] == torch.float32 for n in rest), {n: dtypes[n] for n in rest}

    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    outputs = []
    for model in (bf16, fp32):
        with Precision.create("bf16", CPU).autocast():
            logits = model(input_ids=ids).logits
        logits.float().square().mean().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        outputs.append((logits, grads))
    (a, grads_a), (b, grads_b) = outputs
    assert torch.equal(a, b)
    assert grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)


def test_tied_and_trained_linears_keep_their_dtype():
    embedding = nn.Embedding(8, 4)
    head, trained, frozen = nn.Linear(4, 8, bias=False), nn.Linear(4, 4), nn.Linear(4, 4)
    head.weight = embedding.weight  # tied: a lookup, not autocast
    frozen.requires_grad_(False)
    model = nn.ModuleList([embedding, head, trained, frozen])
    assert store_frozen_linears(model, torch.bfloat16) == 4 * 4 + 4
    assert frozen.weight.dtype == frozen.bias.dtype == torch.bfloat16
    assert embedding.weight.dtype == trained.weight.dtype == torch.float32
    assert store_frozen_linears(model, torch.float32) == 0  # float32 compute: nothing to gain


def test_bf16_master_keeps_lora_adapters_bf16(tiny_llama):
    cfg = ModelConfig(pretrain=str(tiny_llama), param_dtype="bf16", lora_rank=4)
    model = load_causal_lm(dataclasses.replace(cfg, master_dtype="bf16"), CPU)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # peft would upcast the adapters
