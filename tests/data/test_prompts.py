"""RL prompt samples: rendering, labels, extra columns and the prompt-length filter."""

from __future__ import annotations

import datasets
import pytest

from tidal.data import DataError, build_prompt_samples, render_prompt


def test_render_prompt_modes(qwen_tok):
    assert render_prompt("2+2?", qwen_tok, None, False) == "2+2?"
    assert render_prompt("2+2?", qwen_tok, "Q: {}\nA: ", False) == "Q: 2+2?\nA: "
    chat = "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt("2+2?", qwen_tok, None, True) == chat
    assert render_prompt([{"role": "user", "content": "2+2?"}], qwen_tok, None, True) == chat
    with pytest.raises(DataError, match="must contain"):
        render_prompt("x", qwen_tok, "no placeholder", False)


def test_build_prompt_samples_labels_extra_and_length_filter(qwen_tok):
    ds = datasets.Dataset.from_list(
        [
            {"q": "1+1?", "answer": "2", "source": "math"},
            {"q": "word " * 40, "answer": "x", "source": "long"},
            {"q": "3+4?", "answer": "7", "source": "math"},
        ]
    )
    samples, stats = build_prompt_samples(
        ds, qwen_tok, "q", "answer", apply_chat_template=True, max_prompt_len=20
    )
    assert [s.label for s in samples] == ["2", "7"]
    assert samples[0].extra == {"source": "math"}
    assert samples[0].prompt.endswith("<|im_start|>assistant\n")
    assert (stats.too_long, stats.rows) == (1, [1])
    with pytest.raises(DataError, match=r"'label' not found in p\.jsonl"):
        build_prompt_samples(ds, qwen_tok, "q", "label", source="p.jsonl")
    with pytest.raises(DataError, match="no usable prompt"):
        build_prompt_samples(ds, qwen_tok, "q", max_prompt_len=1)
