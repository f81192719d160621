"""``engine_weights``: the engine gets the LoRA-merged weights and the policy's frozen base is untouched."""

from __future__ import annotations

import torch


def lora_policy(path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=16, target_modules="all-linear"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # trained-looking adapters: B is zero at initialisation
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def test_sync_sends_merged_weights_and_restores_the_base_bit_for_bit(tiny_qwen2):
    from tidal.distributed.weight_sync import engine_weights

    model = lora_policy(tiny_qwen2)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    expected_q = layer.base_layer.weight.detach() + layer.get_delta_weight("default")
    for _ in range(3):  # peft's own unmerge (W + d - d) drifts an ulp at some elements per sync
        with engine_weights(model) as named:
            sent = {name: t.detach().clone() for name, t in named}
    torch.testing.assert_close(sent["model.layers.0.self_attn.q_proj.weight"], expected_q)
    assert not torch.equal(
        sent["model.layers.0.self_attn.q_proj.weight"],
        base[next(n for n in base if "layers.0.self_attn.q_proj" in n)],
    )
    after = {n: p.detach() for n, p in model.named_parameters() if "lora_" not in n}
    changed = [n for n in base if not torch.equal(base[n], after[n])]
    assert changed == []
