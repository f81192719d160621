"""Load tokenizers and trainable Hugging Face models (full fine-tuning, LoRA or QLoRA).

Dtypes (``docs/architecture.md``, precision): a model's weights are stored in ``--master_dtype``
(``storage_dtype``; float32 by default, the master copy AdamW updates, so its gradients and moments are
float32 too; bf16 halves all three). With LoRA the frozen ``nn.Linear`` weights are stored in the compute
dtype (``store_frozen_linears``): autocast casts them to it in every matmul anyway, so only memory changes.

A path that cannot be loaded is a ``ConfigError`` naming the path and why, in one line: a folder
without ``config.json``, a truncated or corrupt weights file, a tokenizer with neither a pad nor an
eos token (padding would have no id), rather than a traceback from deep inside ``transformers``.
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import replace
from functools import cache
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn

from tidal.config.args import ConfigError
from tidal.config.model import ModelConfig
from tidal.logging import get_logger
from tidal.logging.phases import phase, size_text
from tidal.models.moe_experts import use_trainer_experts
from tidal.models.precision import resolve_dtype
from tidal.models.vision import is_vision_language, language_lora_targets
from tidal.rollout.models.vision_attention import use_segment_attention


def load_tokenizer(path: str, cfg: ModelConfig | None = None):
    """Load a tokenizer; make sure it has a pad token and apply ``--tokenizer_chat_template``."""
    from transformers import AutoTokenizer

    use_fast = not (cfg and cfg.disable_fast_tokenizer)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, use_fast=use_fast)
    except OSError as err:
        raise ConfigError(f"--pretrain {path}: {_cannot_load(path, 'a tokenizer', err)}") from err
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError(
                f"--pretrain {path}: the tokenizer has neither a pad token nor an eos token; set "
                '"pad_token" or "eos_token" in its tokenizer_config.json'
            )
        # Padding positions are masked everywhere, so reusing eos is safe.
        tokenizer.pad_token = tokenizer.eos_token
    if cfg and cfg.tokenizer_chat_template:
        tokenizer.chat_template = cfg.tokenizer_chat_template
    tokenizer.padding_side = "right"
    return tokenizer


def check_model_folder(path: str, flag: str = "--pretrain") -> None:
    """A local folder must hold ``config.json`` (transformers' own error asks for a ``model_type`` key)."""
    folder = Path(path).expanduser()
    if folder.is_dir() and not (folder / "config.json").is_file():
        raise ConfigError(
            f"{flag} {path}: no config.json in this folder; expected a Hugging Face model folder"
        )


def model_load_error(path: str, err: Exception, flag: str = "--pretrain") -> ConfigError:
    """One line for a model that ``from_pretrained`` could not read."""
    if isinstance(err, SafetensorError):
        return ConfigError(
            f"{flag} {path}: a .safetensors weights file is truncated or corrupt ({_first_line(err)})"
        )
    return ConfigError(f"{flag} {path}: {_cannot_load(path, 'a model', err)}")


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _cannot_load(path: str, what: str, err: Exception) -> str:
    # transformers' message for a name that is neither a folder nor reachable on the hub spans lines
    # and talks about internet connections; say first that no such local folder exists.
    if not Path(path).expanduser().exists():
        return f"no such local folder, and the Hugging Face hub could not provide it ({_first_line(err)})"
    return f"cannot load {what} from it ({type(err).__name__}: {_first_line(err)})"


def _quantization_config():
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except ImportError as err:
        raise ConfigError("--load_in_4bit needs the bitsandbytes package: pip install bitsandbytes") from err
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def apply_lora(model: nn.Module, cfg: ModelConfig, task_type: str = "CAUSAL_LM") -> nn.Module:
    """Wrap ``model`` with peft LoRA adapters; only the adapters (and any head) train."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if cfg.load_in_4bit:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.gradient_checkpointing)
    targets = cfg.target_modules[0] if cfg.target_modules == ["all-linear"] else list(cfg.target_modules)
    lora = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=targets,
        task_type=task_type,
    )
    with warnings.catch_warnings():
        # peft reads transformers' deprecated ``is_gradient_checkpointing`` (a FutureWarning per run
        # that the user cannot act on); only that warning is held back.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        # peft upcasts bf16 adapters to float32 by default; --master_dtype bf16 keeps them bf16 as asked.
        return get_peft_model(model, lora, autocast_adapter_dtype=cfg.master_dtype == "fp32")


@cache
def _say_no_flash_attn() -> None:
    get_logger(__name__).info(
        "--attn_implementation flash_attention_2: the flash-attn package is not installed; using "
        "sdpa, with tidal's varlen attention for packed samples where torch provides it (CUDA)"
    )


def available_attn_implementation(name: str) -> str:
    """``flash_attention_2`` without the flash-attn package becomes ``sdpa`` (said once, at info level):
    most OpenRLHF scripts pass it, and tidal runs packed rows through its own varlen kernel
    (``tidal.models.packed_attention``) instead. Any other name is returned unchanged."""
    if name != "flash_attention_2" or importlib.util.find_spec("flash_attn") is not None:
        return name
    _say_no_flash_attn()
    return "sdpa"


def _attn_implementation(source: str, cfg: ModelConfig) -> str:
    """``--attn_implementation``, except that the default ``sdpa`` becomes ``eager`` for a model class
    without SDPA support (Gemma 2: SDPA cannot soft-cap attention scores), as transformers itself chooses
    when no implementation is given."""
    name = available_attn_implementation(cfg.attn_implementation)
    if name != "sdpa":
        return name
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(source))]
    except (OSError, ValueError, KeyError):
        return "sdpa"  # from_pretrained reports the problem (or custom code decides)
    return "sdpa" if getattr(model_cls, "_supports_sdpa", True) else "eager"


def checkpoint_summary(source: str) -> str:
    """``"4 files, 14.2 GiB"``: the weight files of a local folder (what loading reads)."""
    folder = Path(source)
    files = (
        [f for pattern in ("*.safetensors", "*.bin") for f in folder.glob(pattern)] if folder.is_dir() else []
    )
    if not files:
        return "from the hub cache"
    return (
        f"{len(files)} file{'s' if len(files) > 1 else ''}, {size_text(sum(f.stat().st_size for f in files))}"
    )


def storage_dtype(cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """The dtype ``--master_dtype`` stores a model's weights in on ``device``; bf16 storage with float32
    compute (``--param_dtype fp32``/``fp16``, or ``auto`` on the CPU) is refused in one line: the model
    would silently compute in bf16."""
    if cfg.master_dtype == "fp32":
        return torch.float32
    compute = resolve_dtype(cfg.param_dtype, device)
    if compute != torch.bfloat16:
        raise ConfigError(
            f"--master_dtype bf16 needs bf16 compute, but --param_dtype {cfg.param_dtype} computes in "
            f"{str(compute).removeprefix('torch.')} on {device.type}: add --param_dtype bf16"
        )
    return torch.bfloat16


def store_frozen_linears(model: nn.Module, compute: torch.dtype) -> int:
    """Store every frozen ``nn.Linear`` (LoRA's base layers, a frozen untied LM head) in ``compute`` when it
    is narrower than their dtype; returns the parameters cast. Autocast casts a Linear's weight and bias
    to ``compute`` in every matmul, so a forward gives the same bits; a weight tied to an embedding (a
    lookup, not autocast) keeps its dtype, as do norms and embeddings, which set the residual stream."""
    if compute not in (torch.bfloat16, torch.float16):
        return 0
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    cast = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear) or id(module.weight) in tied:
            continue
        params = [p for p in (module.weight, module.bias) if p is not None]
        if any(p.requires_grad for p in params) or not all(
            p.dtype.itemsize > compute.itemsize for p in params
        ):
            continue
        module.to(compute)
        cast += sum(p.numel() for p in params)
    return cast


def load_causal_lm(
    cfg: ModelConfig,
    device: torch.device,
    path: str | None = None,
    compute_device: torch.device | None = None,
) -> nn.Module:
    """Load a causal LM for training in ``--master_dtype`` (float32 by default), with checkpointing and
    LoRA applied; with LoRA the frozen linear weights are stored in the compute dtype. ``compute_device``:
    where it will compute when that is not ``device`` (a frozen model parked in host memory), which
    resolves ``--param_dtype auto``.

    A vision-language folder (``tidal.models.vision.is_vision_language``) loads as
    ``AutoModelForImageTextToText``, its LoRA adapters on the language model only, its Qwen-VL tower
    attending by runs of equal segments (``tidal.models.vision_attention.use_segment_attention``)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    source = path or cfg.pretrain
    check_model_folder(source)
    vision = is_vision_language(source)
    dtype = storage_dtype(cfg, compute_device or device)
    kwargs: dict = {"dtype": dtype, "attn_implementation": _attn_implementation(source, cfg)}
    if cfg.load_in_4bit:
        kwargs["quantization_config"] = _quantization_config()
    try:
        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        with phase(f"loading {source} ({checkpoint_summary(source)}) in {str(dtype).removeprefix('torch.')}"):
            model = auto.from_pretrained(source, **kwargs)
    except (OSError, ValueError, KeyError, SafetensorError) as err:
        raise model_load_error(source, err) from err
    use_trainer_experts(model)  # MoE experts' grouped GEMMs in the autocast dtype (no-op for dense models)
    if vision:  # the tower's SDPA: one call per run of equal windows/images, not one per window
        use_segment_attention(model)
    if not cfg.load_in_4bit:
        with phase(f"moving {source} to {device}", quiet=None if device.type != "cpu" else True):
            model.to(device)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": cfg.gradient_checkpointing_use_reentrant}
        )
        model.config.use_cache = False
    if cfg.lora_rank > 0:
        targets = language_lora_targets(model, cfg.target_modules) if vision else cfg.target_modules
        model = apply_lora(model, replace(cfg, target_modules=targets))
        if cfg.gradient_checkpointing:
            model.enable_input_require_grads()  # checkpointed blocks need a grad-requiring input
        if not cfg.load_in_4bit:
            store_frozen_linears(model, resolve_dtype(cfg.param_dtype, compute_device or device))
    if cfg.torch_compile:
        from tidal.models.compile import compile_blocks

        compile_blocks(model)
    return model
