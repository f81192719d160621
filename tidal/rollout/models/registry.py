"""The one list of model families tidal's rollout engine implements (HF ``model_type`` -> ``Family``).

Everything that names the supported families reads it: the engine's model construction (``loader.py``)
and its "unsupported model_type" error, ``tidal ppo``'s check before loading, the trainer's chunked LM
head (``tidal.models.logprob_head``), the tiny-model builders of ``tidal.testing``, ``tidal demo``'s
choices and the engine tests. Adding a family is one file under ``tidal/rollout/models/`` (a
``layers.CausalLM`` subclass) plus one ``Family`` line here.

This module is plain data (model classes are named, and imported only when a model is built), so reading
the list costs no model code.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Family:
    """One supported ``model_type``.

    ``model_class``: "module:Class" under ``tidal.rollout.models``. ``tiny``: HF config fields of the tiny
    offline model (``tidal.testing.build_tiny_model``), on top of its shared tiny shapes. ``tiny_adds_bos``:
    the tiny tokenizer prepends a bos token, as the family's real tokenizers do. ``chunkable_head``: the HF
    forward applies nothing after ``lm_head`` (no soft-capping or logit scaling), so the trainer may
    compute log-probs from the hidden states in chunks.
    """

    model_type: str
    model_class: str
    tiny: dict[str, Any] = field(default_factory=dict)
    tiny_adds_bos: bool = False
    chunkable_head: bool = True


# One line per family (the table reads better unwrapped).
# fmt: off
_FAMILIES = (
    Family("llama", "llama:LlamaForCausalLM", dict(tie_word_embeddings=False, rope_theta=10000.0), tiny_adds_bos=True),
    Family("qwen2", "qwen2:Qwen2ForCausalLM", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    Family("qwen3", "qwen3:Qwen3ForCausalLM", dict(tie_word_embeddings=True, rope_theta=1000000.0, head_dim=32)),
    Family("mistral", "llama:LlamaForCausalLM", dict(tie_word_embeddings=False, rope_theta=10000.0, sliding_window=None), tiny_adds_bos=True),
    Family("olmo2", "olmo2:Olmo2ForCausalLM", dict(tie_word_embeddings=False, rope_theta=500000.0)),
)
# fmt: on
FAMILIES: dict[str, Family] = {family.model_type: family for family in _FAMILIES}


class UnsupportedModelError(ValueError):
    """A checkpoint whose ``model_type`` the engine does not implement."""


def supported_model_types() -> tuple[str, ...]:
    """Every supported ``model_type``, sorted (as error messages list them)."""
    return tuple(sorted(FAMILIES))


def family(model_type: str | None, what: str = "the rollout engine") -> Family:
    """The registry entry of ``model_type``; an unsupported one raises naming it and the supported ones."""
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r} for {what}; supported: {', '.join(supported_model_types())}"
        )
    return FAMILIES[model_type]


def model_class(model_type: str | None) -> type:
    """The engine's model class of ``model_type`` (a ``layers.CausalLM`` subclass)."""
    module, _, name = family(model_type).model_class.partition(":")
    return getattr(importlib.import_module(f"tidal.rollout.models.{module}"), name)


def chunkable_model_types() -> frozenset[str]:
    return frozenset(t for t, f in FAMILIES.items() if f.chunkable_head)
