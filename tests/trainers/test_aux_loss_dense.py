"""``--aux_loss_coef`` on a dense model (no router) adds a load-balancing loss of 0 in DPO, KD and KTO,
as in SFT and PPO: the loss equals the loss without the coefficient and nothing raises (OpenRLHF
v0.9.2 fails there with a traceback, or ignores the flag in KD; docs/openrlhf.md)."""

from __future__ import annotations

import pytest
import torch

from tidal.config import ModelConfig
from tidal.data import SFTSample
from tidal.data.pairs import PairSample
from tidal.data.unpaired import UnpairedSample
from tidal.models import Precision, load_causal_lm
from tidal.models.frozen import FrozenModel
from tidal.trainers.dpo import DPOConfig, DPOObjective
from tidal.trainers.kd import KDObjective
from tidal.trainers.kto import KTOConfig, KTOObjective

CPU = torch.device("cpu")
FP32 = Precision.create("fp32", CPU)


def _objective(kind: str, frozen: FrozenModel, coef: float):
    if kind == "dpo":
        samples = [PairSample([5, 6, 7, 8], [5, 6, 9], 2), PairSample([10, 11, 12], [10, 11, 13, 14], 2)]
        return DPOObjective(frozen, DPOConfig(), pad_id=0, aux_loss_coef=coef), samples
    if kind == "kd":
        samples = [SFTSample([5, 6, 7, 8], [0, 0, 1, 1]), SFTSample([9, 10, 11], [0, 1, 1])]
        return KDObjective(frozen, pad_id=0, alpha=0.5, aux_loss_coef=coef), samples
    samples = [UnpairedSample([5, 6], [7, 8], True), UnpairedSample([9, 10], [11], False)]
    return KTOObjective(frozen, KTOConfig(), pad_id=0, aux_loss_coef=coef), samples


@pytest.mark.parametrize("kind", ["dpo", "kd", "kto"])
def test_aux_loss_coef_on_a_dense_model_adds_zero(tiny_llama, kind):
    model = load_causal_lm(ModelConfig(pretrain=str(tiny_llama)), CPU).eval()
    frozen = FrozenModel(load_causal_lm(ModelConfig(pretrain=str(tiny_llama)), CPU), CPU)
    with torch.no_grad():
        losses = {}
        for coef in (0.0, 0.1):
            objective, samples = _objective(kind, frozen, coef)
            losses[coef], metrics = objective.loss(model, objective.collate(samples), 2.0, FP32)
            assert "aux_loss" not in metrics
    assert torch.equal(losses[0.1], losses[0.0])
