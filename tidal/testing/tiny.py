"""Build tiny Hugging Face model folders offline and deterministically.

``build_tiny_model(path, family="llama")`` writes a folder that ``AutoModelForCausalLM`` and
``AutoTokenizer.from_pretrained`` load: a random-init decoder of about 1–5M parameters and a
byte-level BPE tokenizer trained in-process on a generated corpus. Digits are split into single
tokens so that arithmetic tasks are learnable, and the chat template marks assistant turns with
``{% generation %}`` so ``return_assistant_tokens_mask`` works.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tidal.rollout.models.registry import FAMILIES

# Qwen-style names: transformers maps Qwen model types to Qwen2Tokenizer, which expects <|endoftext|>.
PAD, BOS, EOS, IM_START = "<|endoftext|>", "<|bos|>", "<|im_end|>", "<|im_start|>"
SPECIAL_TOKENS = [PAD, BOS, IM_START, EOS]

CHAT_TEMPLATE = (
    "{% if add_bos %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "and",
    "in",
    "is",
    "it",
    "you",
    "that",
    "he",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "I",
    "his",
    "they",
    "be",
    "at",
    "one",
    "have",
    "this",
    "from",
    "or",
    "had",
    "by",
    "word",
    "but",
    "what",
    "some",
    "we",
    "can",
    "out",
    "other",
    "were",
    "all",
    "there",
    "when",
    "up",
    "use",
    "your",
    "how",
    "said",
    "each",
    "she",
    "which",
    "do",
    "their",
    "time",
    "if",
    "will",
    "way",
    "about",
    "many",
    "then",
    "them",
    "write",
    "would",
    "like",
    "so",
    "these",
    "her",
    "long",
    "make",
    "thing",
    "see",
    "him",
    "two",
    "has",
    "look",
    "more",
    "day",
    "could",
    "go",
    "come",
    "did",
    "number",
    "sound",
    "no",
    "most",
    "people",
    "my",
    "over",
    "know",
    "water",
    "than",
    "call",
    "first",
    "who",
    "may",
    "down",
    "side",
    "been",
    "now",
    "find",
    "any",
    "new",
    "work",
    "part",
    "take",
    "get",
    "place",
    "made",
    "live",
    "where",
    "after",
    "back",
    "little",
    "only",
    "round",
    "man",
    "year",
    "came",
    "show",
    "every",
    "good",
    "me",
    "give",
    "our",
    "under",
    "name",
    "very",
    "through",
    "just",
    "form",
    "sentence",
    "great",
    "think",
    "say",
    "help",
    "low",
    "line",
    "differ",
    "turn",
    "cause",
    "much",
    "mean",
    "before",
    "move",
    "right",
    "boy",
    "old",
    "too",
    "same",
    "tell",
    "does",
    "set",
    "three",
    "want",
    "air",
    "well",
    "also",
    "play",
    "small",
    "end",
    "put",
    "home",
    "read",
    "hand",
    "port",
    "large",
    "spell",
    "add",
    "even",
    "land",
    "here",
    "must",
    "big",
    "high",
    "such",
    "follow",
    "act",
    "why",
    "ask",
    "men",
    "change",
    "went",
    "light",
    "kind",
    "off",
    "need",
    "house",
    "picture",
    "try",
    "us",
    "again",
    "animal",
    "point",
    "mother",
    "world",
    "near",
    "build",
    "self",
    "earth",
    "father",
    "question",
    "answer",
    "user",
    "assistant",
    "system",
    "sum",
    "plus",
    "equals",
    "result",
    "reward",
    "step",
    "think",
    "solve",
    "problem",
    "correct",
    "wrong",
    "number",
    "digit",
    "carry",
]


def _corpus(seed: int, n_lines: int = 3000) -> list[str]:
    """A deterministic mix of prose, arithmetic and chat-like lines to train the BPE merges on."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        kind = i % 3
        if kind == 0:
            lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14))) + ".")
        elif kind == 1:
            a, b = rng.randint(0, 99999), rng.randint(0, 99999)
            lines.append(f"What is {a}+{b}? {a}+{b}={a + b}")
        else:
            lines.append(
                f"user\n{' '.join(rng.choice(_WORDS) for _ in range(6))}?\nassistant\nThe answer is {i}."
            )
    return lines


def build_tiny_tokenizer(
    path: str | Path | None = None, vocab_size: int = 512, seed: int = 0, add_bos: bool = True
):
    """Train a byte-level BPE tokenizer in-process and wrap it as a HF fast tokenizer.

    ``add_bos`` makes plain encoding prepend ``<|bos|>`` (Llama style); Qwen-style tokenizers add none.
    """
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits first, one per token: multi-digit merges would make arithmetic much harder to learn.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer)
    if add_bos:
        bos_id = tok.token_to_id(BOS)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
        )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=4096
    )
    # The template adds bos itself only for Llama-style tokenizers (apply_chat_template never adds it).
    hf_tok.chat_template = CHAT_TEMPLATE.replace("add_bos", "true" if add_bos else "false")
    if path is not None:
        hf_tok.save_pretrained(str(path))
    return hf_tok


# Shapes shared by every family; all tiny (about 1.7-1.9M parameters with the 512-token vocabulary).
_BASE = dict(
    hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2
)
# Each supported family's own fields come from the engine's registry of families.
TINY_FAMILIES = {t: dict(model_type=t, **family.tiny) for t, family in FAMILIES.items()}


def _check_family(family: str) -> None:
    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; expected one of {sorted(TINY_FAMILIES)}")


def tiny_config(
    family: str = "llama", vocab_size: int = 512, max_position_embeddings: int = 1024, **overrides
):
    """A HF config of the given family with tiny shapes; ``overrides`` replace any field."""
    from transformers import AutoConfig

    _check_family(family)
    fields = {**_BASE, **TINY_FAMILIES[family], **overrides}
    model_type = fields.pop("model_type")
    return AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        **fields,
    )


def tokenizer_fields(tokenizer) -> dict[str, int]:
    """The model-config fields a tiny model takes from its tokenizer: the vocabulary size and the
    bos/eos/pad token ids."""
    return {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def build_tiny_model(
    path: str | Path,
    family: str = "llama",
    seed: int = 0,
    vocab_size: int = 512,
    logit_scale: float = 1.0,
    **config_overrides,
) -> Path:
    """Write a random-init tiny model and its tokenizer to ``path`` (a plain HF folder) and return it.

    A random-init model predicts an almost uniform next token; ``logit_scale`` multiplies the final
    norm's effective weight (so every logit) to give peaked distributions like a trained model's."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    _check_family(family)  # before anything is written to ``path``
    tokenizer = build_tiny_tokenizer(
        path, vocab_size=vocab_size, seed=seed, add_bos=FAMILIES[family].tiny_adds_bos
    )
    config = tiny_config(family, **tokenizer_fields(tokenizer), **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    with torch.no_grad():
        norm = model.model.norm.weight
        # Zero-centred norms (Gemma, Qwen3.5: ``x * (1 + w)``) start at w = 0: scale 1 + w, not w.
        offset = 1.0 if bool((norm == 0).all()) else 0.0
        norm.copy_((norm + offset) * logit_scale - offset)
    model.save_pretrained(str(path))
    return path


def perturbed_copy(model_dir: str | Path, out: str | Path, scale: float, seed: int) -> Path:
    """``model_dir``'s model (and tokenizer) saved to ``out`` with ``scale`` x N(0, 1) (seeded) added to
    every weight: a reference, teacher or policy that differs from the original one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return Path(out)


# Families transformers has but tidal's engine does not implement (they run on the transformers fallback,
# ``tidal.rollout.engine.hf_engine``): their tiny HF config fields. bamba is a hybrid Mamba-2 / attention decoder
# (attention in layers 1 and 3); gpt2 a learned-position, LayerNorm decoder.
TINY_FALLBACK_FAMILIES = {
    "bamba": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        attn_layer_indices=[1, 3], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=16,
        rms_norm_eps=1e-6, max_position_embeddings=1024, tie_word_embeddings=False,
    ),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=1024),
}  # fmt: skip


def build_tiny_fallback_model(
    path: str | Path, family: str = "bamba", seed: int = 0, vocab_size: int = 512
) -> Path:
    """Like ``build_tiny_model``, for a family of ``TINY_FALLBACK_FAMILIES`` (not in the engine's registry)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if family not in TINY_FALLBACK_FAMILIES:
        raise ValueError(
            f"unknown tiny fallback family {family!r}; expected one of {sorted(TINY_FALLBACK_FAMILIES)}"
        )
    path = Path(path)
    tokenizer = build_tiny_tokenizer(path, vocab_size=vocab_size, seed=seed, add_bos=False)
    config = AutoConfig.for_model(family, **tokenizer_fields(tokenizer), **TINY_FALLBACK_FAMILIES[family])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(path))
    return path
