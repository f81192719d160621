"""Model configuration: which checkpoint, numeric precision, attention kernel, checkpointing, LoRA."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config.args import NON_NEGATIVE, POSITIVE, Checked, Range, arg

PARAM_DTYPES = ("auto", "bf16", "fp16", "fp32")
MASTER_DTYPES = ("fp32", "bf16")


@dataclass
class ModelConfig(Checked):
    """Model: checkpoint, precision and memory options."""

    pretrain: str = arg(help="HF model name or local folder to start from (required)", metavar="PATH")
    param_dtype: str = arg(
        "auto",
        help="compute dtype; weights and optimizer state are stored in --master_dtype (auto: bf16 on CUDA, "
        "fp32 on CPU)",
        choices=PARAM_DTYPES,
    )
    master_dtype: str = arg(
        "fp32",
        help="dtype of a trained model's stored weights, gradients and AdamW moments (tidal extension). fp32: "
        "a float32 master copy (16 bytes/param with AdamW). bf16: 8 bytes/param, as TRL/verl with a bf16 "
        "model; updates smaller than bf16's resolution are lost. bf16 needs --param_dtype bf16 (or auto on CUDA)",
        choices=MASTER_DTYPES,
    )
    attn_implementation: str = arg(
        "sdpa",
        help="attention kernel passed to transformers",
        choices=("sdpa", "eager", "flash_attention_2", "flex_attention"),
    )
    gradient_checkpointing: bool = arg(False, help="recompute activations in backward to save memory")
    torch_compile: bool = arg(
        False, help="compile each transformer block with torch.compile (CUDA; the first steps compile)"
    )
    gradient_checkpointing_use_reentrant: bool = arg(
        False, help="use the reentrant checkpoint implementation"
    )
    disable_fast_tokenizer: bool = arg(False, help="load the slow (Python) tokenizer")
    tokenizer_chat_template: str | None = arg(
        None, help="Jinja chat template that replaces the tokenizer's own"
    )
    aux_loss_coef: float = arg(
        0.0,
        help="MoE load-balancing loss coefficient (needs a model that returns aux_loss)",
        check=NON_NEGATIVE,
    )
    lora_rank: int = arg(0, help="LoRA rank; 0 trains all weights", check=NON_NEGATIVE)
    lora_alpha: int = arg(16, help="LoRA alpha", check=POSITIVE)
    lora_dropout: float = arg(0.0, help="LoRA dropout", check=Range(0, 1, high_open=True))
    target_modules: list[str] = arg(["all-linear"], help="modules that get LoRA adapters", nargs="+")
    load_in_4bit: bool = arg(
        False, help="QLoRA: load the base model in 4-bit (needs bitsandbytes and --lora_rank)"
    )

    def problems(self, flags=None) -> list[str]:
        own = []
        if self.load_in_4bit and self.lora_rank <= 0:
            own.append("--load_in_4bit trains LoRA adapters on a 4-bit base: set --lora_rank > 0")
        if self.master_dtype == "bf16" and self.param_dtype in ("fp16", "fp32"):
            own.append(
                f"--master_dtype bf16 stores weights in bf16 and computes in bf16: use --param_dtype bf16 "
                f"(not {self.param_dtype})"
            )
        return super().problems(flags) + own  # --lora_rank < 0: its range check
