"""``tidal ppo`` (GRPO) with images on the tiny Gemma 3 VLM and the colour task (test_vlm_grpo.py's flags).

The engine generates with Gemma 3's bidirectional image attention; the trainer's transformers forward
gets the same samples' pixels (back from tidal's patch rows) and ``token_type_ids``, so old log-probs
equal the engine's within float32 noise, before and after the weight sync (``--freeze_visual_encoder``:
the tower and projector stay as loaded, only the language model is synced). Packing is refused: before
loading in ``tidal ppo``, and at the forward for any trainer that packs image rows.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.trainers.test_vlm_grpo import _flags
from tidal.cli.train_ppo import parse_run
from tidal.config import ConfigError
from tidal.testing import build_tiny_vlm
from tidal.trainers.ppo import run_ppo


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("gemma3") / "policy", "gemma3")


def test_grpo_on_images_engine_logprobs_match_the_trainer(gemma3, tmp_path):
    history = run_ppo(parse_run(_flags(gemma3, tmp_path, "--freeze_visual_encoder")))
    assert len(history) == 2
    mismatch = [step["rollout/logprob_mismatch"] for step in history]
    print(f"Gemma 3 VLM GRPO |Δ log-prob| per step: {mismatch}")
    assert max(mismatch) < 1e-3  # the second rollout ran on the synced weights
    before, after = (
        load_file(gemma3 / "model.safetensors"),
        load_file(tmp_path / "rl" / "final" / "model.safetensors"),
    )
    name = {
        k: [n for n in after if k in n]
        for k in ("layers.0.mlp.gate_proj.", "mm_input_projection", "encoder.layers.0.self_attn.q_proj.")
    }
    lm, projector, tower = (names[0] for names in name.values())  # as transformers saves them
    assert not torch.equal(before[lm], after[lm])
    torch.testing.assert_close(before[projector], after[projector])
    torch.testing.assert_close(before[tower], after[tower])


def test_packing_with_images_is_refused(gemma3, tmp_path):
    from transformers import AutoConfig

    from tidal.models.vision import vision_kwargs

    with pytest.raises(
        ConfigError, match="--packing_samples: packing_samples is not supported for the gemma3 "
    ):
        run_ppo(parse_run(_flags(gemma3, tmp_path, "--packing_samples")))
    model = torch.nn.Module()
    model.config = AutoConfig.from_pretrained(str(gemma3))
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "pixel_values": torch.zeros(16, 192),
             "image_grid_thw": torch.tensor([[1, 4, 4]]), "segment_ids": torch.zeros(1, 4)}  # fmt: skip
    with pytest.raises(ValueError, match="--packing_samples with images is not supported for gemma3"):
        vision_kwargs(model, batch)
    del batch["segment_ids"]
    kwargs = vision_kwargs(model, batch)
    assert kwargs["pixel_values"].shape == (1, 3, 32, 32) and kwargs["token_type_ids"].sum() == 0
