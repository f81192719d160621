"""Unpaired (KTO) samples: rendering, separate prompt/response tokens, labels, skips and errors."""

from __future__ import annotations

import datasets
import pytest

from tidal.data import DataError
from tidal.data.unpaired import UnpairedDataConfig, build_unpaired_samples


def rows(*items):
    return datasets.Dataset.from_list([{"input": p, "output": r, "label": lab} for p, r, lab in items])


def test_plain_text_prompt_and_response_tokens(llama_tok):
    ds = rows(("1+2=", "3", True), ("4+4=", "9", False))
    cfg = UnpairedDataConfig(input_template="Q: {}\nA: ")
    samples, stats = build_unpaired_samples(ds, llama_tok, cfg)
    assert stats.count == 0 and [s.desirable for s in samples] == [True, False]
    first = samples[0]
    # The prompt gets bos (plain-text rule), the response none of its own; eos closes it.
    assert first.prompt_ids == llama_tok("Q: 1+2=\nA: ")["input_ids"]
    assert first.prompt_ids[0] == llama_tok.bos_token_id
    assert first.response_ids == llama_tok("3", add_special_tokens=False)["input_ids"] + [
        llama_tok.eos_token_id
    ]
    sft = first.as_sft()
    assert sft.input_ids == first.prompt_ids + first.response_ids
    assert sft.loss_mask == [0] * len(first.prompt_ids) + [1] * len(first.response_ids)


def test_chat_template_response_is_the_assistant_turn(qwen_tok):
    ds = rows(("What is 2+2?", "4", 1), ("Hi", "Hello", 0))
    samples, _ = build_unpaired_samples(ds, qwen_tok, UnpairedDataConfig(apply_chat_template=True))
    prompt = qwen_tok.decode(samples[0].prompt_ids)
    assert prompt.endswith("<|im_start|>assistant\n") and "What is 2+2?" in prompt
    assert qwen_tok.decode(samples[0].response_ids) == "4<|im_end|>"
    assert [s.desirable for s in samples] == [True, False]


def test_mismatched_pair_joins_prompt_and_other_response(llama_tok):
    a, b = build_unpaired_samples(
        rows(("x", "one", True), ("y", "two", False)), llama_tok, UnpairedDataConfig()
    )[0]
    mixed = a.with_response(b)
    assert mixed.prompt_ids == a.prompt_ids and mixed.response_ids == b.response_ids
    assert llama_tok.decode(mixed.as_sft().input_ids, skip_special_tokens=True) == "xtwo"


def test_too_long_rows_are_skipped_and_counted(llama_tok):
    ds = rows(("1+1=", "2", True), ("1+1=", "word " * 40, False))
    samples, stats = build_unpaired_samples(ds, llama_tok, UnpairedDataConfig(max_len=16))
    assert len(samples) == 1 and stats.too_long == 1 and stats.rows == [1]


@pytest.mark.parametrize(("labels", "bad_row"), [([1, 2], 2), (["true", "yes"], 1), ([0.0, 0.5], 2)])
def test_bad_label_names_the_row(llama_tok, labels, bad_row):
    ds = datasets.Dataset.from_list([{"input": "a", "output": "b", "label": x} for x in labels])
    with pytest.raises(DataError, match=f"row {bad_row} of kto.jsonl: label 'label' must be true/false"):
        build_unpaired_samples(ds, llama_tok, UnpairedDataConfig(), source="kto.jsonl")


def test_missing_value_names_the_row(llama_tok):
    ds = datasets.Dataset.from_list(
        [{"input": "a", "output": "b", "label": True}, {"input": "c", "label": False}]
    )
    with pytest.raises(DataError, match="row 2 of kto.jsonl: key 'output' has no value"):
        build_unpaired_samples(ds, llama_tok, UnpairedDataConfig(), source="kto.jsonl")


def test_missing_key_lists_columns(llama_tok):
    with pytest.raises(DataError, match="'answer' not found in kto.jsonl"):
        build_unpaired_samples(
            rows(("a", "b", True)), llama_tok, UnpairedDataConfig(output_key="answer"), "kto.jsonl"
        )
