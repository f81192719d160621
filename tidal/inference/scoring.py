"""Score generated samples with a reward model (``--reward_pretrain``), in padded micro-batches.

The reward model reads each sample's token ids as generated — prompt ids followed by response ids,
including the eos the policy produced (token-in-token-out, as the PPO trainer scores rollouts) — so
it must share the policy's tokenizer; that is checked when it is loaded. Sequences are sorted by
length before batching so that a micro-batch pads little.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tidal.config.args import ConfigError
from tidal.config.model import ModelConfig
from tidal.data.collate import collate_padded
from tidal.data.sft import SFTSample
from tidal.models.precision import Precision
from tidal.models.value_model import load_value_model


class SampleScorer:
    """Rewards of token-id sequences from a value-head reward model."""

    def __init__(self, model, pad_token_id: int, precision: Precision, micro_batch_size: int):
        self.model = model.eval().requires_grad_(False)
        self.pad_token_id, self.precision, self.micro_batch_size = pad_token_id, precision, micro_batch_size

    @classmethod
    def load(
        cls,
        path: str,
        policy_tokenizer,
        *,
        value_head_prefix: str = "score",
        normalize_reward: bool = False,
        param_dtype: str = "auto",
        micro_batch_size: int = 16,
        device: torch.device | None = None,
        flag: str = "--reward_pretrain",
    ) -> SampleScorer:
        """``flag``: the flag that named ``path``, for errors (``--pretrain`` in batch_inference's rm mode)."""
        device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        check_same_tokenizer(path, policy_tokenizer, flag)
        try:
            model = load_value_model(
                ModelConfig(pretrain=path), device, value_head_prefix, normalize_reward=normalize_reward,
                trained_head=True,
            )  # fmt: skip
        except ConfigError as err:  # the loader speaks of --pretrain; name the flag that gave the path
            raise ConfigError(f"{flag} {path}: {err}") from err
        precision = Precision.create(param_dtype, device)
        return cls(model, policy_tokenizer.pad_token_id, precision, micro_batch_size)

    @torch.no_grad()
    def __call__(self, sequences: Sequence[Sequence[int]]) -> list[float]:
        """One reward per sequence, in the given order."""
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        rewards = [0.0] * len(sequences)
        device = next(self.model.parameters()).device
        for start in range(0, len(order), self.micro_batch_size):
            chunk = order[start : start + self.micro_batch_size]
            samples = [SFTSample(list(sequences[i]), [0] * len(sequences[i])) for i in chunk]
            batch = {k: v.to(device) for k, v in collate_padded(samples, self.pad_token_id).items()}
            with self.precision.autocast():
                scores = self.model.scores(batch).float().tolist()
            for i, score in zip(chunk, scores, strict=True):
                rewards[i] = score
        return rewards


def check_same_tokenizer(path: str, policy_tokenizer, flag: str = "--reward_pretrain") -> None:
    """The model at ``path`` (a reward model, or ``--teacher_model``) scores the policy's token ids,
    so both must use one vocabulary; ``flag`` names it in errors."""
    from transformers import AutoTokenizer

    try:
        rm_tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):  # a weights-only folder: at least every policy token must embed
        _check_vocab_size(path, len(policy_tokenizer), flag)
        return
    if rm_tokenizer.get_vocab() != policy_tokenizer.get_vocab():
        raise ConfigError(
            f"{flag} {path} has a different tokenizer than --pretrain: the model reads "
            "the policy's token ids, so both must share one tokenizer"
        )


def _check_vocab_size(path: str, num_tokens: int, flag: str = "--reward_pretrain") -> None:
    from transformers import AutoConfig

    try:
        vocab_size = AutoConfig.from_pretrained(path).vocab_size
    except OSError as err:
        raise ConfigError(f"{flag} {path}: cannot load a model config from it ({err})") from err
    if vocab_size < num_tokens:
        raise ConfigError(
            f"{flag} {path} has {vocab_size} token embeddings but the policy's tokenizer has "
            f"{num_tokens} tokens: the model must share the policy's tokenizer"
        )
