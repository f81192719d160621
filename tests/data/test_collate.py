"""Padded and packed collation, and the next-token target alignment across packed boundaries."""

from __future__ import annotations

import torch

from tidal.data import SFTSample, collate_packed, collate_padded, next_token_targets

PAD = 0
SAMPLES = [
    SFTSample([5, 6, 7, 8], [0, 0, 1, 1], row=0),
    SFTSample([9, 10], [0, 1], row=1),
    SFTSample([11, 12, 13], [1, 1, 1], row=2),  # a bad first-token mask must not leak through
]


def test_collate_padded_shapes_and_values():
    batch = collate_padded(SAMPLES, PAD)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, PAD, PAD], [11, 12, 13, PAD]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1], [0, 1, 0, 0], [0, 1, 1, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 0, 0], [0, 1, 2, 0]]


def test_collate_packed_positions_segments_and_boundaries():
    batch = collate_packed(SAMPLES, PAD)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2]]
    assert batch["segment_ids"].tolist() == [[0, 0, 0, 0, 1, 1, 2, 2, 2]]
    assert batch["seq_lens"].tolist() == [4, 2, 3]
    assert batch["cu_seqlens"].tolist() == [0, 4, 6, 9] and batch["cu_seqlens"].dtype == torch.int32
    starts = batch["cu_seqlens"][:-1].long()
    assert batch["loss_mask"][0, starts].tolist() == [0, 0, 0]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 0, 1, 0, 1, 1]]


def test_padded_and_packed_hold_the_same_tokens_and_targets():
    padded, packed = collate_padded(SAMPLES, PAD), collate_packed(SAMPLES, PAD)
    real = padded["attention_mask"].bool()
    assert padded["input_ids"][real].tolist() == packed["input_ids"][0].tolist()
    assert padded["loss_mask"][real].tolist() == packed["loss_mask"][0].tolist()
    assert padded["position_ids"][real].tolist() == packed["position_ids"][0].tolist()


def test_next_token_targets_never_cross_a_packed_boundary():
    packed = collate_packed(SAMPLES, PAD)
    targets = next_token_targets(packed["input_ids"], packed["loss_mask"])
    # position t predicts token t + 1; last token of a sample (positions 3 and 5) is ignored
    assert targets.tolist() == [[-100, 7, 8, -100, 10, -100, 12, 13, -100]]
    padded = collate_padded(SAMPLES, PAD)
    assert next_token_targets(padded["input_ids"], padded["loss_mask"]).tolist() == [
        [-100, 7, 8, -100],
        [10, -100, -100, -100],
        [12, 13, -100, -100],
    ]
