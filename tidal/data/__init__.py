"""Data layer: dataset loading/blending, prompt and SFT sample building, collation and batching.

See ``tidal.data.collate`` for the loss-mask convention (``loss_mask[t] == 1`` means token ``t`` is a
target predicted from position ``t - 1``) and the keys of padded and packed micro-batches.
"""

from tidal.data.batching import epoch_permutation, micro_batches, step_batches, steps_per_epoch
from tidal.data.collate import IGNORE_INDEX, collate_packed, collate_padded, next_token_targets
from tidal.data.loading import DataError, load_dataset_spec, load_source, parse_probs, require_keys
from tidal.data.prompts import PromptSample, build_prompt_samples
from tidal.data.sft import SFTDataConfig, SFTSample, SkipStats, build_sft_samples
from tidal.data.templates import render_prompt, render_response, tokenize_texts

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
