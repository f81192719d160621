"""``tidal ppo`` (GRPO) with images on the tiny Qwen2.5-VL and the colour task (answer only in the image).

The engine generates from the prompts' images (vision tower in prefill, M-RoPE); the trainer's forward
gets the same samples' pixels, so old log-probs equal the engine's within float32 noise, before and after
the weight sync (``--freeze_visual_encoder``: the vision tower stays as loaded and only the language model
is synced). Runs padded and packed (``--packing_samples``: per-sample M-RoPE positions).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tidal.cli.train_ppo import parse_run
from tidal.config import ConfigError
from tidal.rollout.models.registry import VISION_FAMILIES
from tidal.testing import ColourTask, build_tiny_vlm
from tidal.trainers.ppo import entry as ppo_entry
from tidal.trainers.ppo import run_ppo

# Dense and image-dependent: the share of the response's letters that are letters of the colour's name.
REWARD = """
import torch


def reward_func(queries, prompts, labels, **kwargs):
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels):
        letters = [c for c in query[len(prompt):].lower() if c.isalpha()]
        rewards.append(sum(c in label for c in letters) / max(len(letters), 1))
    return {"rewards": torch.tensor(rewards), "scores": torch.tensor(rewards)}
"""


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "policy")


def _flags(policy, tmp_path, *extra) -> list[str]:
    data = ColourTask(seed=2).write_jsonl(tmp_path / "data" / "prompts.jsonl", 8)
    reward = tmp_path / "colour_reward.py"
    reward.write_text(REWARD)
    return [
        "--pretrain", str(policy), "--prompt_data", str(data), "--input_key", "prompt", "--label_key", "answer",
        "--apply_chat_template", "--remote_rm_url", str(reward), "--advantage_estimator", "group_norm",
        "--n_samples_per_prompt", "4", "--rollout_batch_size", "4", "--train_batch_size", "16",
        "--micro_train_batch_size", "8", "--micro_rollout_batch_size", "8", "--generate_max_len", "6",
        "--prompt_max_len", "64", "--actor_learning_rate", "1e-3", "--lr_warmup_ratio", "0", "--init_kl_coef", "0",
        "--max_images_per_prompt", "1", "--save_path", str(tmp_path / "rl" / "final"),
        "--ckpt_path", str(tmp_path / "rl" / "ckpt"), "--seed", "3", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("family", "packing"),
    [("qwen2_5_vl", False), ("qwen2_5_vl", True), ("qwen3_vl", True), ("qwen3_5", False)],
    ids=["padded", "packed", "qwen3_vl-packed", "qwen3_5-padded"],  # Qwen3.5's hybrid refuses packing
)
def test_grpo_on_images_engine_logprobs_match_the_trainer(vlm, tmp_path, family, packing):
    extra = ["--packing_samples"] if packing else []
    if family != "qwen2_5_vl":
        vlm = build_tiny_vlm(tmp_path / family, family)
    history = run_ppo(parse_run(_flags(vlm, tmp_path, "--freeze_visual_encoder", *extra)))
    assert len(history) == 2
    mismatch = [step["rollout/logprob_mismatch"] for step in history]
    print(f"VLM GRPO ({'packed' if packing else 'padded'}) |Δ log-prob| per step: {mismatch}")
    assert max(mismatch) < 1e-3  # the second rollout ran on the synced weights
    before, after = (
        load_file(vlm / "model.safetensors"),
        load_file(tmp_path / "rl" / "final" / "model.safetensors"),
    )
    lm = [n for n in after if "layers.0.mlp.gate_proj.weight" in n][0]
    tower = [n for n in after if "blocks.0.attn.qkv.weight" in n][0]
    assert not torch.equal(
        before[lm.replace("language_model.", "")] if lm not in before else before[lm], after[lm]
    )
    torch.testing.assert_close(
        before[tower] if tower in before else before[tower.replace("model.", "", 1)], after[tower]
    )


def test_image_flags_openrlhf_spellings_and_refusals(vlm, tmp_path, monkeypatch):
    from tidal.config.data import VisionConfig
    from tidal.testing import build_tiny_model

    flags = _flags(vlm, tmp_path)
    flags[flags.index("--max_images_per_prompt")] = "--data.max_images_per_prompt"  # OpenRLHF HEAD's names
    run = parse_run([*flags, "--data.image_key", "images", "--actor.freeze_visual_encoder"])
    assert run.vision == VisionConfig(image_key="images", max_images_per_prompt=1, freeze_visual_encoder=True)

    assert parse_run(
        _flags(vlm, tmp_path, "--advantage_estimator", "gae")
    ).algorithm.needs_critic  # test_vlm_critic
    qwen3_5 = build_tiny_vlm(tmp_path / "q35", "qwen3_5")  # Gated DeltaNet: packing refused before loading
    with pytest.raises(
        ConfigError, match="--packing_samples: packing_samples is not supported for the qwen3_5 "
    ):
        run_ppo(parse_run(_flags(qwen3_5, tmp_path, "--packing_samples")))
    qwen3_vl = build_tiny_vlm(tmp_path / "q3", "qwen3_vl")
    # a vision-language family the engine lacks: Qwen3-VL taken out of tidal ppo's view of the registry
    monkeypatch.setattr(
        ppo_entry, "VISION_FAMILIES", {k: f for k, f in VISION_FAMILIES.items() if k != "qwen3_vl"}
    )
    with pytest.raises(ConfigError, match="qwen3_vl is a vision-language model the rollout engine does not"):
        run_ppo(parse_run(_flags(qwen3_vl, tmp_path)))
    text_model = build_tiny_model(tmp_path / "text", "qwen2")
    with pytest.raises(ConfigError, match="needs a vision-language model"):
        run_ppo(parse_run(_flags(text_model, tmp_path)))


def test_experience_rows_keep_their_images_through_select_concat_and_batches():
    """``Experience.images``: rows select and concatenate with their pixels; a micro-batch's inputs hold
    its rows' images in order (``image_counts`` per row; packed rows also get ``seq_lens``)."""
    from tidal.experience.experience import Experience, model_batch
    from tidal.experience.images import ExperienceImages

    def image(value, n):  # n images of 4 patches each, every pixel = value
        return torch.full((4 * n, 8), float(value)), torch.tensor([[1, 2, 2]] * n)

    def exp(rows, images):
        seq = torch.arange(rows * 5).view(rows, 5)
        ones = torch.ones_like(seq)
        return Experience(seq, ones, ones, ones.float(), torch.zeros(rows), torch.zeros(rows), images=images)

    a = exp(3, ExperienceImages([image(1, 1), None, image(3, 2)]))
    both = Experience.concat([a, exp(2, None)])
    assert [r is None for r in both.images.rows] == [False, True, False, True, True]
    picked = both.select([4, 2, 0])
    batch = model_batch(picked, packing=False)
    assert batch["image_counts"].tolist() == [0, 2, 1]
    assert batch["pixel_values"][:, 0].tolist() == [3.0] * 8 + [1.0] * 4  # rows in order, images in order
    assert batch["image_grid_thw"].shape == (3, 3)
    packed = model_batch(picked, packing=True)
    assert packed["seq_lens"].tolist() == [5, 5, 5] and packed["image_counts"].tolist() == [0, 2, 1]
    assert "pixel_values" not in model_batch(both.select([1, 3]), packing=True)


def test_grpo_on_images_raises_the_reward(vlm, tmp_path):
    """Eight GRPO steps of 4 prompts x 8 samples raise the (dense) colour-letter reward."""
    flags = _flags(vlm, tmp_path, "--n_samples_per_prompt", "8", "--train_batch_size", "32",
                   "--micro_train_batch_size", "16", "--micro_rollout_batch_size", "32", "--num_episodes", "4")  # fmt: skip
    flags[flags.index("--actor_learning_rate") + 1] = "2e-2"
    rewards = [step["reward"] for step in run_ppo(parse_run(flags))]
    print(f"VLM GRPO reward per step: {[round(r, 3) for r in rewards]}")
    assert len(rewards) == 8
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.05, rewards
