"""Data layer: dataset loading/blending, prompt and SFT sample building, collation and batching.

See ``tidal.data.collate`` for the loss-mask convention (``loss_mask[t] == 1`` means token ``t`` is a
target predicted from position ``t - 1``) and the keys of padded and packed micro-batches.
"""

from typing import TYPE_CHECKING

from tidal.lazy import lazy_exports

if TYPE_CHECKING:  # the same names for type checkers, and for tests/test_imports.py's import graph
    from tidal.data.batching import epoch_permutation, micro_batches, step_batches, steps_per_epoch
    from tidal.data.collate import IGNORE_INDEX, collate_packed, collate_padded, next_token_targets
    from tidal.data.errors import DataError
    from tidal.data.loading import load_dataset_spec, load_source, parse_probs
    from tidal.data.prompts import PromptSample, build_prompt_samples
    from tidal.data.rows import require_keys
    from tidal.data.sft import SFTDataConfig, SFTSample, SkipStats, build_sft_samples
    from tidal.data.templates import render_prompt, render_response, tokenize_texts

# name → the submodule that defines it, imported when the name is first used (see tidal.lazy)
_EXPORTS = {
    "DataError": "tidal.data.errors",
    "IGNORE_INDEX": "tidal.data.collate",
    "PromptSample": "tidal.data.prompts",
    "SFTDataConfig": "tidal.data.sft",
    "SFTSample": "tidal.data.sft",
    "SkipStats": "tidal.data.sft",
    "build_prompt_samples": "tidal.data.prompts",
    "build_sft_samples": "tidal.data.sft",
    "collate_packed": "tidal.data.collate",
    "collate_padded": "tidal.data.collate",
    "epoch_permutation": "tidal.data.batching",
    "load_dataset_spec": "tidal.data.loading",
    "load_source": "tidal.data.loading",
    "micro_batches": "tidal.data.batching",
    "next_token_targets": "tidal.data.collate",
    "parse_probs": "tidal.data.loading",
    "render_prompt": "tidal.data.templates",
    "render_response": "tidal.data.templates",
    "require_keys": "tidal.data.rows",
    "step_batches": "tidal.data.batching",
    "steps_per_epoch": "tidal.data.batching",
    "tokenize_texts": "tidal.data.templates",
}

__all__ = [
    "IGNORE_INDEX",
    "DataError",
    "PromptSample",
    "SFTDataConfig",
    "SFTSample",
    "SkipStats",
    "build_prompt_samples",
    "build_sft_samples",
    "collate_packed",
    "collate_padded",
    "epoch_permutation",
    "load_dataset_spec",
    "load_source",
    "micro_batches",
    "next_token_targets",
    "parse_probs",
    "render_prompt",
    "render_response",
    "require_keys",
    "step_batches",
    "steps_per_epoch",
    "tokenize_texts",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
