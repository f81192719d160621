"""Preference pairs: rendering, prompt lengths, skipping, margins and the chosen-then-rejected collate."""

from __future__ import annotations

import datasets
import pytest
import torch

from tidal.data import DataError
from tidal.data.pairs import PairDataConfig, PairSample, build_pair_samples, collate_pairs

TEMPLATE = "User: {}\nAssistant: "


def _ds(rows):
    return datasets.Dataset.from_list(rows)


def _ids(tok, text, special):
    return tok(text, add_special_tokens=special)["input_ids"]


def test_prompt_key_with_template_gives_exact_ids_and_prompt_len(any_tok):
    tok = any_tok
    rows = [{"q": "2+3?", "good": "5", "bad": "6", "margin": 1.5}, {"q": "7+8?", "good": "15", "bad": "14"}]
    cfg = PairDataConfig(prompt_key="q", chosen_key="good", rejected_key="bad", input_template=TEMPLATE)
    samples, stats = build_pair_samples(_ds(rows), tok, cfg)
    assert stats.count == 0 and [s.margin for s in samples] == [1.5, 0.0]
    for s, row in zip(samples, rows, strict=True):
        prompt = TEMPLATE.format(row["q"])
        assert s.chosen_ids == _ids(tok, prompt + row["good"] + tok.eos_token, True)
        assert s.rejected_ids == _ids(tok, prompt + row["bad"] + tok.eos_token, True)
        assert s.prompt_len == len(_ids(tok, prompt, True))
        assert tok.decode(s.chosen_ids[s.prompt_len :]) == row["good"] + tok.eos_token


def test_message_lists_with_chat_template(any_tok):
    tok = any_tok
    user = [{"role": "user", "content": "name a colour"}]
    row = {
        "chosen": user + [{"role": "assistant", "content": "blue"}],
        "rejected": user + [{"role": "assistant", "content": "the number seven"}],
    }
    samples, _ = build_pair_samples(_ds([row]), tok, PairDataConfig(apply_chat_template=True))
    (s,) = samples
    prompt = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    assert s.prompt_len == len(_ids(tok, prompt, False))
    assert tok.decode(s.chosen_ids[s.prompt_len :]) == "blue<|im_end|>"
    assert tok.decode(s.rejected_ids[s.prompt_len :]) == "the number seven<|im_end|>"
    assert s.chosen_ids[: s.prompt_len] == s.rejected_ids[: s.prompt_len]

    # With a prompt key, string responses become the assistant turn: the same sequences.
    keyed = {"prompt": "name a colour", "chosen": "blue", "rejected": "the number seven"}
    cfg = PairDataConfig(prompt_key="prompt", apply_chat_template=True)
    (k,), _ = build_pair_samples(_ds([keyed]), tok, cfg)
    assert (k.chosen_ids, k.rejected_ids, k.prompt_len) == (s.chosen_ids, s.rejected_ids, s.prompt_len)


def test_long_pairs_are_skipped_and_counted(llama_tok):
    rows = [{"chosen": "short", "rejected": "tiny"}, {"chosen": "word " * 50, "rejected": "x"}]
    samples, stats = build_pair_samples(_ds(rows), llama_tok, PairDataConfig(max_len=20))
    assert [s.row for s in samples] == [0]
    assert stats.too_long == 1 and stats.rows == [1]
    with pytest.raises(DataError, match="no usable preference pair"):
        build_pair_samples(_ds(rows[1:]), llama_tok, PairDataConfig(max_len=20))


@pytest.mark.parametrize(
    ("rows", "cfg", "message"),
    [
        (
            [{"chosen": "a", "rejected": "b", "margin": "big"}],
            PairDataConfig(),
            "row 1 of dataset.*margin 'big'",
        ),
        ([{"chosen": "a", "other": "b"}], PairDataConfig(), "'rejected' not found"),
        (
            [{"chosen": "a", "rejected": None}],
            PairDataConfig(),
            "row 1 of dataset.*key 'rejected' has no value",
        ),
        (
            [{"chosen": [{"role": "user", "content": "a"}], "rejected": "b"}],
            PairDataConfig(),
            "row 1 of dataset.*list",
        ),
        ([{"chosen": "a", "rejected": "b"}], PairDataConfig(input_template="Q: {}"), "--prompt_key"),
    ],
)
def test_bad_rows_fail_clearly(llama_tok, rows, cfg, message):
    with pytest.raises(DataError, match=message):
        build_pair_samples(_ds(rows), llama_tok, cfg)


def test_collate_pairs_padded_and_packed_agree():
    samples = [PairSample([5, 6, 7], [5, 6, 8, 9], 2, 0.5, 0), PairSample([1, 2], [1, 3, 4], 1, 0.0, 1)]
    padded = collate_pairs(samples, pad_id=0)
    assert padded["input_ids"].tolist() == [[5, 6, 7, 0], [1, 2, 0, 0], [5, 6, 8, 9], [1, 3, 4, 0]]
    assert padded["attention_mask"].sum(1).tolist() == [3, 2, 4, 3]
    assert padded["loss_mask"].tolist() == [[0, 0, 1, 0], [0, 1, 0, 0], [0, 0, 1, 1], [0, 1, 1, 0]]
    assert padded["position_ids"][2].tolist() == [0, 1, 2, 3]
    assert padded["margin"].tolist() == [0.5, 0.0]

    packed = collate_pairs(samples, pad_id=0, packing=True)
    assert packed["input_ids"].tolist() == [[5, 6, 7, 1, 2, 5, 6, 8, 9, 1, 3, 4]]
    assert packed["seq_lens"].tolist() == [3, 2, 4, 3]
    assert packed["segment_ids"].tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3]]
    assert torch.equal(packed["loss_mask"][0], padded["loss_mask"][padded["attention_mask"].bool()])
