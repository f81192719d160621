"""Reward and value models: a HF ``*ForSequenceClassification`` model (``num_labels=1``) whose head is
applied to every hidden state.

``load_value_model`` loads ``AutoModelForSequenceClassification`` (from a causal LM the head starts
random, as in OpenRLHF) and mixes ``ValueHeadMixin`` into its class, which adds:

- ``forward(input_ids, attention_mask, position_ids)`` → per-token values ``[B, T]`` (float32);
- ``values(batch)`` the same for a collated batch, padded or packed (``tidal.models.forward``); the
  PPO critic uses it. Under ``--ring_attn_size`` a packed row runs as ring attention over the ring
  group, each rank valuing its chunk, and the ``[T]`` values are all-gathered into the whole row;
- ``scores(batch)`` → ``[B]`` the value at the last real token of each row (the rightmost position
  with ``attention_mask == 1``, so left and right padding both work) or, for a packed row, of each
  segment; with ``normalize_reward`` it returns ``(score − config.mean) / config.std`` (a config without
  a stored mean/std normalises with 0 and 1, i.e. not at all, as OpenRLHF; a log line says so).

``forward`` is overridden (rather than calling the base model from ``values``) so that FSDP2's hooks
on the root module, which gather the head and the embeddings, run.

The head is the attribute named by ``--value_head_prefix`` (default ``score``, the name HF uses).
The state dict therefore is exactly the HF one: a model saved with prefix ``score`` loads with
``AutoModelForSequenceClassification.from_pretrained`` and gives the same scores, provided the
config's ``pad_token_id`` is the tokenizer's (HF pools at the rightmost non-pad token). Another
prefix is saved as ``<prefix>.weight`` and mapped back to ``score`` on load (``key_mapping``).
Training writes ``value_head_prefix``, ``mean`` and ``std`` into the config (``reward_config``).

A fresh head is right for a model about to be trained (the PPO critic built from the policy, a
reward model trained by ``tidal rm``), and wrong for a reward model that scores: ``trained_head=True``
refuses a checkpoint whose weights have no head (a plain causal LM passed as ``--reward_pretrain``),
which would otherwise score with random weights.
"""

from __future__ import annotations

import contextlib
import logging
import re

import torch
from torch import Tensor, nn

from tidal.config.args import ConfigError
from tidal.config.model import ModelConfig
from tidal.logging import get_logger
from tidal.models.forward import model_inputs, ring_chunk
from tidal.models.loading import (
    _quantization_config,
    apply_lora,
    available_attn_implementation,
    storage_dtype,
    store_frozen_linears,
)
from tidal.models.moe_experts import use_trainer_experts
from tidal.models.precision import resolve_dtype

log = get_logger(__name__)

HF_HEAD = "score"


class ValueHeadMixin:
    """Per-token values and per-sequence scores for a HF sequence-classification model."""

    value_head_prefix: str = HF_HEAD
    normalize_reward: bool = False
    reward_mean: float = 0.0
    reward_std: float = 1.0

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs) -> Tensor:
        # peft's sequence-classification wrapper passes HF keyword arguments we have no use for.
        for unused in ("labels", "output_attentions", "output_hidden_states", "return_dict", "task_ids"):
            kwargs.pop(unused, None)
        base = getattr(self, self.base_model_prefix)
        hidden = base(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **kwargs,
        ).last_hidden_state
        # A fresh tensor, not a view of the head output: FSDP2 warns about (and mishandles in-place ops
        # on) view outputs of a sharded module. [B, T] is small.
        return getattr(self, self.value_head_prefix)(hidden).squeeze(-1).float().clone()

    def values(self, batch: dict) -> Tensor:
        """Per-token values ``[B, T]`` of a padded or packed batch. Under ring attention a packed row is
        split over the ring group: each rank values its chunk and the values of the whole row are
        gathered (``forward.RingChunk.whole``), so every rank reads any token's value, as one process."""
        chunk = ring_chunk(batch)
        if chunk is None:
            return self(**model_inputs(self, batch))
        return chunk.whole(self(**chunk.model_kwargs(self)))

    def scores(self, batch: dict) -> Tensor:
        """One value per sequence: ``[B]`` (padded) or ``[num_segments]`` (packed)."""
        return self.normalize(last_token_values(self.values(batch), batch))

    def normalize(self, rewards: Tensor) -> Tensor:
        if not self.normalize_reward:
            return rewards
        return (rewards - self.reward_mean) / self.reward_std


def last_token_values(values: Tensor, batch: dict) -> Tensor:
    """The value at the last real token of each row (padded) or segment (packed)."""
    if "segment_ids" in batch:
        ends = batch["seq_lens"].to(values.device).cumsum(0) - 1
        return values[0, ends]
    mask = batch["attention_mask"].to(values.device)
    positions = torch.arange(mask.shape[-1], device=values.device)
    last = (positions * (mask != 0)).argmax(-1)
    return values[torch.arange(values.shape[0], device=values.device), last]


def attach_value_head(model: nn.Module, value_head_prefix: str = HF_HEAD) -> nn.Module:
    """Give a HF sequence-classification model ``ValueHeadMixin``'s methods; (re)name its head."""
    cls = type(model)
    if not isinstance(model, ValueHeadMixin):
        # Same class name, so save_pretrained still records the HF architecture in config.json.
        model.__class__ = type(cls.__name__, (ValueHeadMixin, cls), {"__module__": cls.__module__})
    current = model.value_head_prefix  # "score" (HF's name) until renamed
    if value_head_prefix != current:
        head = getattr(model, current)
        delattr(model, current)
        model.add_module(value_head_prefix, head)
    model.value_head_prefix = value_head_prefix
    return model


def load_value_model(
    cfg: ModelConfig,
    device: torch.device,
    value_head_prefix: str = HF_HEAD,
    path: str | None = None,
    normalize_reward: bool = False,
    trained_head: bool = False,
) -> nn.Module:
    """Load a reward/value model in ``--master_dtype`` (float32 by default; see the module doc and
    ``tidal.models.loading``), with checkpointing and LoRA (frozen linears in the compute dtype).

    ``trained_head``: the checkpoint must hold the head's weights (a reward model that scores);
    otherwise a missing head is initialised at random (a critic or a reward model to be trained)."""
    dtype = storage_dtype(cfg, device)
    model = _from_pretrained(cfg, path or cfg.pretrain, value_head_prefix, trained_head, dtype)
    use_trainer_experts(model)  # MoE experts' grouped GEMMs in the autocast dtype, as the policy's
    attach_value_head(model, value_head_prefix)
    if normalize_reward:
        _enable_normalization(model, path or cfg.pretrain)
    if not cfg.load_in_4bit:
        model.to(device)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": cfg.gradient_checkpointing_use_reentrant}
        )
    if cfg.lora_rank > 0:
        model = _lora(model, cfg, value_head_prefix)
        if not cfg.load_in_4bit:
            store_frozen_linears(model, resolve_dtype(cfg.param_dtype, device))
    return model


def _from_pretrained(
    cfg: ModelConfig, source: str, value_head_prefix: str, trained_head: bool, dtype: torch.dtype
) -> nn.Module:
    from transformers import AutoConfig, AutoModelForSequenceClassification

    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value_head_prefix):
        raise ConfigError(f"--value_head_prefix {value_head_prefix!r} must be a Python identifier")
    try:
        config = AutoConfig.from_pretrained(source)
    except OSError as err:
        raise ConfigError(f"cannot load a model config from {source} ({err})") from err
    saved = getattr(config, "value_head_prefix", None)
    if saved is not None and saved != value_head_prefix:
        raise ConfigError(
            f"{source} was saved with --value_head_prefix {saved}, not {value_head_prefix}: "
            f"pass --value_head_prefix {saved}"
        )
    config.num_labels = 1
    config.use_cache = False
    kwargs: dict = {
        "config": config,
        "dtype": dtype,
        "attn_implementation": available_attn_implementation(cfg.attn_implementation),
    }
    if value_head_prefix != HF_HEAD:
        kwargs["key_mapping"] = {rf"^{value_head_prefix}\.": f"{HF_HEAD}."}
    if cfg.load_in_4bit:
        kwargs["quantization_config"] = _quantization_config()
    try:
        with quiet_load_report():
            model, info = AutoModelForSequenceClassification.from_pretrained(
                source, output_loading_info=True, **kwargs
            )
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot load a sequence-classification model from {source} ({err})") from err
    if trained_head:
        check_trained_head(source, value_head_prefix, info)
    warn_missing_body_weights(source, info)
    return model


QUIET_LOAD_LOGGERS = ("modeling_utils", "distributed.tensor_parallel")


@contextlib.contextmanager
def quiet_load_report():
    """Hold back transformers' load report (a warning table) while loading a value model: building one
    from a causal LM always lists ``lm_head`` unexpected and ``score.weight`` missing, which is the
    design (a new head), not a problem. tidal reads the same loading info itself: a missing trained
    head is refused (``check_trained_head``), other missing weights are warned about
    (``warn_missing_body_weights``)."""
    # transformers checks the tensor-parallel plan (and warns on its own logger) whenever the
    # modeling_utils logger's level is WARNING or above, so that logger is held back too.
    loggers = [logging.getLogger(f"transformers.{name}") for name in QUIET_LOAD_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger, level in zip(loggers, levels, strict=True):
        logger.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def warn_missing_body_weights(source: str, loading_info: dict) -> None:
    """One warning when weights other than the value head were missing (initialised at random)."""
    missing = sorted(k for k in loading_info.get("missing_keys", ()) if not k.startswith(f"{HF_HEAD}."))
    if missing:
        log.warning(
            "%s: %d weights missing from the checkpoint were initialised at random: %s",
            source, len(missing), ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else ""),
        )  # fmt: skip


def check_trained_head(source: str, value_head_prefix: str, loading_info: dict) -> None:
    """Refuse a checkpoint without the head's weights (transformers' load report lists it missing:
    the head would start random); suggest ``--value_head_prefix`` when another head is present."""
    if not any(key.startswith(f"{HF_HEAD}.") for key in loading_info.get("missing_keys", ())):
        return
    unexpected = {key.split(".")[0] for key in loading_info.get("unexpected_keys", ()) if "." in key}
    kind = " (it is a causal LM: lm_head, no value head)" if "lm_head" in unexpected else ""
    hint = "".join(
        f"; they have a '{name}' layer: if that is the head, pass --value_head_prefix {name}"
        for name in sorted(unexpected - {"lm_head"})[:1]
    )
    raise ConfigError(
        f"{source} has no trained value head: its weights have no '{value_head_prefix}.weight'{kind}, so it "
        f"would score with a random head; expected a reward model saved by `tidal rm`{hint}"
    )


def _enable_normalization(model: nn.Module, source: str) -> None:
    mean, std = getattr(model.config, "mean", None), getattr(model.config, "std", None)
    if mean is None or std is None:
        # OpenRLHF v0.9.2 keeps mean 0 and std 1 when the config stores none: the scores stay as they are.
        log.info(
            "--normalize_reward: %s stores no reward mean/std (tidal rm --normalize_reward writes them); "
            "its scores are used as they are (mean 0, std 1, as OpenRLHF)",
            source,
        )
        return
    if not std > 0:
        raise ConfigError(f"--normalize_reward: {source} stores a non-positive reward std {std}")
    model.normalize_reward, model.reward_mean, model.reward_std = True, float(mean), float(std)


def _lora(model: nn.Module, cfg: ModelConfig, value_head_prefix: str) -> nn.Module:
    """LoRA adapters on the body; peft's SEQ_CLS task keeps a head named ``score`` fully trainable and
    saves it with the adapters, so LoRA goes on while the head is still called ``score``."""
    inner = model
    if value_head_prefix != HF_HEAD:
        attach_value_head(inner, HF_HEAD)
    lora_model = apply_lora(model, cfg, task_type="SEQ_CLS")
    if value_head_prefix != HF_HEAD:
        attach_value_head(inner, value_head_prefix)  # the wrapped head keeps its trainable copy
        peft_config = lora_model.peft_config["default"]
        peft_config.modules_to_save = [
            value_head_prefix if name == HF_HEAD else name for name in peft_config.modules_to_save
        ]
    if cfg.gradient_checkpointing:
        lora_model.enable_input_require_grads()
    return lora_model


def reward_config(model: nn.Module, tokenizer, mean: float | None = None, std: float | None = None) -> dict:
    """Config fields a trained reward model is saved with (see the module doc)."""
    fields = {"value_head_prefix": getattr(model, "value_head_prefix", HF_HEAD)}
    # HF pools at the rightmost token that is not pad_token_id, so it must be the tokenizer's pad.
    fields["pad_token_id"] = tokenizer.pad_token_id
    if tokenizer.pad_token_id == tokenizer.eos_token_id:
        log.warning(
            "pad token == eos token: AutoModelForSequenceClassification will score the token before "
            "a trailing eos, while tidal scores the eos itself"
        )
    if mean is not None and std is not None:
        fields["mean"], fields["std"] = float(mean), float(std)
    return fields
