"""lora_combiner: the merged model computes what base + adapters compute (causal LM and reward
model), saves a plain HF folder, and rejects mismatched inputs clearly."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from tidal.cli.lora_combiner import main as combine_main
from tidal.config import ModelConfig
from tidal.models import apply_lora


def save_adapters(base, path, task_type):
    """LoRA on ``base`` with random (non-zero) B matrices, saved as a LoRA run saves it."""
    model = apply_lora(base, ModelConfig(pretrain="unused", lora_rank=4, lora_alpha=8), task_type=task_type)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model.save_pretrained(path)
    return path


def inputs(tokenizer):
    batch = tokenizer(["12+34=46", "hello there"], return_tensors="pt", padding=True)
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def test_merged_causal_lm_equals_base_plus_adapters(tiny_llama, tmp_path):
    adapters = save_adapters(AutoModelForCausalLM.from_pretrained(tiny_llama), tmp_path / "lora", "CAUSAL_LM")
    combine_main(["--model_path", str(tiny_llama), "--lora_path", str(adapters),
                  "--output_path", str(tmp_path / "merged"), "--param_dtype", "fp32"])  # fmt: skip
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with_adapters = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_llama), adapters
    ).eval()
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    batch = inputs(AutoTokenizer.from_pretrained(tmp_path / "merged"))
    with torch.no_grad():
        want, got, base = (m(**batch).logits for m in (with_adapters, merged, plain))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (want - base).abs().max() > 1e-3  # the adapters really change the model


def test_merged_reward_model_equals_base_plus_adapters(tiny_qwen2, tmp_path):
    def rm():
        return AutoModelForSequenceClassification.from_pretrained(tiny_qwen2, num_labels=1)

    adapters = save_adapters(rm(), tmp_path / "lora", "SEQ_CLS")
    combine_main(["--model_path", str(tiny_qwen2), "--lora_path", str(adapters),
                  "--output_path", str(tmp_path / "merged"), "--is_rm", "--param_dtype", "fp32"])  # fmt: skip
    merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged").eval()
    with_adapters = PeftModel.from_pretrained(rm(), adapters).eval()
    batch = inputs(AutoTokenizer.from_pretrained(tmp_path / "merged"))
    with torch.no_grad():
        torch.testing.assert_close(merged(**batch).logits, with_adapters(**batch).logits, atol=1e-5, rtol=0)


def test_default_dtype_is_bf16(tiny_llama, tmp_path):
    adapters = save_adapters(AutoModelForCausalLM.from_pretrained(tiny_llama), tmp_path / "lora", "CAUSAL_LM")
    combine_main(
        ["--model_path", str(tiny_llama), "--lora_path", str(adapters), "--output_path", str(tmp_path / "m")]
    )
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype="auto")
    assert next(merged.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize(("is_rm", "message"), [(True, "not a reward model"), (False, "add --is_rm")])
def test_task_mismatch_and_missing_adapters_fail_clearly(tiny_llama, tmp_path, capsys, is_rm, message):
    base = AutoModelForCausalLM if is_rm else AutoModelForSequenceClassification
    task = "CAUSAL_LM" if is_rm else "SEQ_CLS"
    adapters = save_adapters(base.from_pretrained(tiny_llama), tmp_path / "lora", task)
    argv = [
        "--model_path",
        str(tiny_llama),
        "--lora_path",
        str(adapters),
        "--output_path",
        str(tmp_path / "m"),
    ]
    with pytest.raises(SystemExit) as exc:
        combine_main(argv + (["--is_rm"] if is_rm else []))
    assert exc.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        combine_main(
            [
                "--model_path",
                str(tiny_llama),
                "--lora_path",
                str(tmp_path),
                "--output_path",
                str(tmp_path / "m"),
            ]
        )
    assert "no adapter_config.json" in capsys.readouterr().err
