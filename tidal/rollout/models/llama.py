"""Llama and Mistral: the base shape of ``layers.py`` as it is (pre-norm, packed q/k/v and gate/up, RoPE).

Mistral differs from Llama only by its config (a sliding window over every layer, read by
``layers.sliding_windows``), so both ``model_type``s map to this class in ``registry.py``.
"""

from __future__ import annotations

from tidal.rollout.models.layers import CausalLM


class LlamaForCausalLM(CausalLM):
    """Llama / Mistral: everything as declared by ``CausalLM``."""
