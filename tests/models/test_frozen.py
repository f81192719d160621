"""``FrozenModel``: no gradients, eval mode inside ``use()`` (the mode restored after), and with
offload the weights live on the CPU and visit the compute device only inside ``use()``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tidal.models.frozen import FrozenModel

DEVICE = torch.device("cuda", 0)  # only recorded: the moves below are not performed


class RecordsMoves(nn.Linear):
    """Records where ``to`` is asked to move it (without moving, so the test runs on the CPU)."""

    def __init__(self):
        super().__init__(2, 2)
        self.moves: list[torch.device] = []

    def to(self, device):
        self.moves.append(torch.device(device))
        return self


@pytest.mark.parametrize("offload", [False, True])
def test_use_yields_an_eval_model_without_gradients(offload):
    model = RecordsMoves().train()
    frozen = FrozenModel(model, torch.device("cpu"), offload)
    assert not any(p.requires_grad for p in model.parameters())
    model.train()  # even when something switched it back to training
    with frozen.use() as inside:
        assert inside is model and not model.training and not torch.is_grad_enabled()
        out = inside(torch.ones(1, 2))
    assert model.training and not out.requires_grad


def test_offloaded_model_visits_the_device_only_inside_use():
    model = RecordsMoves()
    frozen = FrozenModel(model, DEVICE, offload=True)
    assert model.moves == [torch.device("cpu")]
    with pytest.raises(RuntimeError, match="boom"), frozen.use():
        assert model.moves[-1] == DEVICE
        raise RuntimeError("boom")
    assert model.moves == [torch.device("cpu"), DEVICE, torch.device("cpu")]  # back even after an error


def test_model_stays_put_without_offload():
    model = RecordsMoves()
    with FrozenModel(model, DEVICE).use():
        pass
    assert model.moves == []
