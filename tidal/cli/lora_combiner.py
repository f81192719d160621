"""``tidal lora_combiner`` / ``python -m tidal.cli.lora_combiner``: merge LoRA adapters into their
base model and save a plain Hugging Face folder (weights + tokenizer) that needs no peft.

LoRA/QLoRA runs save only their adapters (``adapter_config.json`` + ``adapter_model.safetensors``).
The merge (peft ``merge_and_unload``: W ← W + (α/r)·B·A) runs in float32; the result is then cast
to ``--param_dtype``. ``--is_rm`` loads the base as ``AutoModelForSequenceClassification`` with one
label, as reward models are; its value head travels with the adapters (peft ``modules_to_save``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from tidal.cli.common import make_parser, module_main, run_command
from tidal.config import ConfigError, arg, config_from_args
from tidal.logging import get_logger

log = get_logger(__name__)

# --param_dtype → torch dtype name (torch is imported by the merge, not by --help)
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass
class LoraCombineConfig:
    """Merge LoRA adapters into a base model."""

    model_path: str = arg(help="base model the adapters were trained on (HF folder or name)")
    lora_path: str = arg(
        help="folder with adapter_config.json and the adapter weights (the run's --save_path)"
    )
    output_path: str = arg(help="folder for the merged Hugging Face model and its tokenizer")
    is_rm: bool = arg(
        False, help="the adapters belong to a reward model (AutoModelForSequenceClassification)"
    )
    param_dtype: str = arg(
        "bf16", help="dtype of the saved weights (the merge runs in float32)", choices=tuple(DTYPES)
    )


def adapter_task(lora_path: Path, is_rm: bool) -> str:
    """The adapters' peft task type, checked against ``--is_rm``."""
    config_file = lora_path / "adapter_config.json"
    if not config_file.is_file():
        raise ConfigError(
            f"--lora_path {lora_path}: no adapter_config.json (is it a LoRA run's --save_path?)"
        )
    task = json.loads(config_file.read_text()).get("task_type") or "CAUSAL_LM"
    if is_rm and task != "SEQ_CLS":
        raise ConfigError(
            f"--is_rm was given but the adapters in {lora_path} are for task {task}, not a reward model"
        )
    if not is_rm and task == "SEQ_CLS":
        raise ConfigError(f"the adapters in {lora_path} belong to a reward model (task SEQ_CLS): add --is_rm")
    return task


def load_base(model_path: str, is_rm: bool):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    try:
        if is_rm:
            return AutoModelForSequenceClassification.from_pretrained(
                model_path, num_labels=1, dtype=torch.float32
            )
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    except OSError as err:
        raise ConfigError(f"--model_path {model_path}: cannot load a model from it ({err})") from err


def load_tokenizer_for(cfg: LoraCombineConfig):
    """The tokenizer saved with the adapters (it may carry a chat template), else the base's."""
    from transformers import AutoTokenizer

    source = cfg.lora_path if (Path(cfg.lora_path) / "tokenizer_config.json").is_file() else cfg.model_path
    return AutoTokenizer.from_pretrained(source)


def combine(cfg: LoraCombineConfig) -> Path:
    """Merge ``cfg.lora_path`` into ``cfg.model_path`` and write ``cfg.output_path``; returns it."""
    import torch
    from peft import PeftModel

    lora_path, output = Path(cfg.lora_path), Path(cfg.output_path)
    adapter_task(lora_path, cfg.is_rm)
    base = load_base(cfg.model_path, cfg.is_rm)
    tokenizer = load_tokenizer_for(cfg)
    if cfg.is_rm and base.config.pad_token_id is None:
        # HF sequence classifiers pool at the last non-pad token, so the pad id must be known.
        base.config.pad_token_id = tokenizer.pad_token_id
    try:
        model = PeftModel.from_pretrained(base, str(lora_path))
    except (ValueError, KeyError, RuntimeError) as err:
        raise ConfigError(
            f"--lora_path {lora_path} does not fit --model_path {cfg.model_path}: {err}"
        ) from err
    merged = model.merge_and_unload().to(getattr(torch, DTYPES[cfg.param_dtype]))
    output.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(str(output), safe_serialization=True)
    tokenizer.save_pretrained(str(output))
    log.info("merged %s into %s → %s (%s)", lora_path, cfg.model_path, output, cfg.param_dtype)
    return output


def build_parser(prog: str = "tidal lora_combiner") -> argparse.ArgumentParser:
    return make_parser(
        prog,
        "Merge LoRA adapters into their base model.",
        [(LoraCombineConfig, "LoRA merge")],
        command="lora_combiner",
    )


def main(argv: list[str] | None = None, prog: str = "tidal lora_combiner"):
    return run_command(build_parser(prog), argv, lambda ns: combine(config_from_args(LoraCombineConfig, ns)))


if __name__ == "__main__":
    module_main(lambda argv: main(argv, prog="python -m tidal.cli.lora_combiner"))
