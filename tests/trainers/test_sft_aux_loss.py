"""SFT ``--aux_loss_coef`` on a dense model adds nothing (0, as OpenRLHF), instead of an error."""

from __future__ import annotations

import torch

from tidal.cli.train_sft import parse_run
from tidal.data import collate_padded
from tidal.models import Precision, load_causal_lm
from tidal.testing import AdditionTask
from tidal.trainers import sft as sft_module


def test_aux_loss_coef_on_a_dense_model_is_zero(tiny_llama, tmp_path):
    data = AdditionTask(digits=2).write_jsonl(tmp_path / "train.jsonl", 8)
    run = parse_run(["--pretrain", str(tiny_llama), "--dataset", str(data), "--input_key", "prompt",
                     "--output_key", "answer", "--max_len", "64", "--aux_loss_coef", "0.1"])  # fmt: skip
    from transformers import AutoTokenizer

    samples = sft_module.load_sft_samples(
        str(data), None, "train", 4, AutoTokenizer.from_pretrained(tiny_llama), run.data, 0
    )
    model = load_causal_lm(run.model, torch.device("cpu")).eval()
    batch = collate_padded(samples, 0)
    precision = Precision.create("fp32", torch.device("cpu"))
    with torch.no_grad():
        with_coef, metrics = sft_module.SFTObjective(pad_id=0, aux_loss_coef=0.1).loss(
            model, batch, 10.0, precision
        )
        without, _ = sft_module.SFTObjective(pad_id=0).loss(model, batch, 10.0, precision)
    assert torch.equal(with_coef, without) and "aux_loss" not in metrics
