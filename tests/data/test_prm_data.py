"""PRM samples: step-marker positions, hard/soft/vocabulary labels, clear errors, padded/packed collate."""

from __future__ import annotations

import copy

import datasets
import pytest
import torch

from tidal.data import DataError
from tidal.data.prm import PRMDataConfig, PRMSample, build_prm_samples, collate_prm, reward_token_ids

MARK = "ки"


@pytest.fixture(scope="module")
def tok(llama_tok):
    tok = copy.deepcopy(llama_tok)
    tok.add_tokens([MARK])
    return tok


def _ds(rows):
    return datasets.Dataset.from_list(rows)


def test_hard_labels_sit_on_the_markers(tok):
    rows = [
        {"input": f"one plus one ки is two {MARK}", "label": ["+", "-"]},
        {"input": "x ки", "label": ["-"]},
    ]
    cfg = PRMDataConfig(reward_tokens=["+", "-"])
    samples, stats = build_prm_samples(_ds(rows), tok, cfg)
    assert stats.count == 0
    marker = tok.convert_tokens_to_ids(MARK)
    for s, row in zip(samples, rows, strict=True):
        assert s.input_ids == tok(row["input"])["input_ids"]  # plain text keeps the tokenizer's bos
        assert [s.input_ids[p] for p in s.step_positions] == [marker] * len(row["label"])
    assert samples[0].step_labels == [0, 1] and samples[1].step_labels == [1]
    assert reward_token_ids(tok, cfg) == [tok.convert_tokens_to_ids("+"), tok.convert_tokens_to_ids("-")]


def test_soft_and_vocabulary_labels(tok):
    rows = [{"input": "a ки b ки", "label": [0.25, 1]}]
    (soft,), _ = build_prm_samples(_ds(rows), tok, PRMDataConfig(reward_tokens=["+", "-"]))
    assert soft.step_labels == [0.25, 1.0]
    rows = [{"input": "a ки b ки", "label": ["+", "-"]}]
    (vocab,), _ = build_prm_samples(_ds(rows), tok, PRMDataConfig())
    assert vocab.step_labels == tok.convert_tokens_to_ids(["+", "-"])


def test_long_rows_are_skipped(tok):
    rows = [{"input": "a ки", "label": ["+"]}, {"input": "word " * 40 + "ки", "label": ["+"]}]
    samples, stats = build_prm_samples(_ds(rows), tok, PRMDataConfig(reward_tokens=["+", "-"], max_len=16))
    assert [s.row for s in samples] == [0] and stats.too_long == 1


@pytest.mark.parametrize(
    ("rows", "cfg", "message"),
    [
        ([{"input": "a ки b", "label": ["+", "+"]}], {}, "row 1 of dataset.*1 'ки' step marker.*2 label"),
        (
            [{"input": "a ки", "label": ["?"]}],
            {},
            r"row 1 of dataset.*\['\?'\] are not among --reward_tokens",
        ),
        ([{"input": "a ки", "label": [1.5]}], {}, r"row 1 of dataset.*\[0, 1\]"),
        ([{"input": "a ки", "label": [0.5]}], {"reward_tokens": ["+", "-", "="]}, "exactly two"),
        ([{"input": "a ки", "label": "+"}], {}, "row 1 of dataset.*non-empty list"),
        (
            [{"input": "a step", "label": ["+"]}],
            {"placeholder_token": "<step>"},
            "--placeholder_token '<step>'",
        ),
        ([{"input": "a ки", "label": ["+"]}], {"reward_tokens": ["++x", "-"]}, "--reward_tokens '\\+\\+x'"),
    ],
)
def test_bad_rows_fail_clearly(tok, rows, cfg, message):
    cfg = PRMDataConfig(**{"reward_tokens": ["+", "-"], **cfg})
    with pytest.raises(DataError, match=message):
        build_prm_samples(_ds(rows), tok, cfg)


def test_collate_padded_and_packed():
    samples = [PRMSample([1, 7, 9, 7], [1, 3], [0, 1], 0), PRMSample([1, 5, 9], [2], [1], 1)]
    padded = collate_prm(samples, pad_id=0)
    assert padded["input_ids"].tolist() == [[1, 7, 9, 7], [1, 5, 9, 0]]
    assert padded["placeholder_mask"].tolist() == [[0, 1, 0, 1], [0, 0, 1, 0]]
    assert padded["labels"].dtype == torch.long and padded["labels"].tolist() == [[0, 0, 0, 1], [0, 0, 1, 0]]
    packed = collate_prm(samples, pad_id=0, packing=True)
    assert packed["placeholder_mask"].tolist() == [[0, 1, 0, 1, 0, 0, 1]]
    assert packed["labels"][packed["placeholder_mask"]].tolist() == [0, 1, 1]
    assert packed["seq_lens"].tolist() == [4, 3]
    soft = collate_prm([PRMSample([1, 7], [1], [0.3], 0)], pad_id=0)
    assert soft["labels"].dtype == torch.float32 and soft["labels"][0, 1].item() == pytest.approx(0.3)
