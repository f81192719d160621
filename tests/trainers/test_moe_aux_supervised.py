"""``--aux_loss_coef`` in the supervised trainers on a mixture-of-experts model: packed rows work (HF's
own aux loss fails on a packed 4-D mask), packed and padded batches give the same load-balancing term,
and it equals HF's ``aux_loss`` on the padded batch."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tidal.data import collate_packed, collate_padded
from tidal.data.sft import SFTSample
from tidal.models import Precision
from tidal.trainers.sft import SFTObjective

SAMPLES = [
    SFTSample([1, 40, 41, 42, 43, 44, 3], [0, 1, 1, 1, 1, 1, 1]),
    SFTSample([1, 50, 3], [0, 1, 1]),
    SFTSample([1, 60, 61, 62, 63, 64, 65, 66, 67, 3], [0, 1, 1, 1, 1, 1, 1, 1, 1, 1]),
]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    from tidal.testing import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe"), "qwen3_moe", seed=0)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def test_packed_and_padded_aux_terms_agree_and_match_hf(moe_model):
    coef, precision = 0.1, Precision.create("fp32", torch.device("cpu"))
    objective = SFTObjective(pad_id=0, aux_loss_coef=coef)
    normaliser = float(sum(sum(s.loss_mask) for s in SAMPLES))
    _, packed = objective.loss(moe_model, collate_packed(SAMPLES), normaliser, precision)
    padded_batch = collate_padded(SAMPLES, 0)
    _, padded = objective.loss(moe_model, padded_batch, normaliser, precision)
    torch.testing.assert_close(packed["aux_loss"], padded["aux_loss"], rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        hf = moe_model(
            input_ids=padded_batch["input_ids"],
            attention_mask=padded_batch["attention_mask"],
            output_router_logits=True,
        ).aux_loss
    # The whole batch is one micro-batch: its token share is 1.
    torch.testing.assert_close(padded["aux_loss"], coef * hf, rtol=1e-5, atol=1e-7)
    assert padded["aux_loss"] > 0
