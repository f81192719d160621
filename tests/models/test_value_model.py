"""Value/reward model: per-token values on padded and packed batches, last-token scores, HF round trip."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForSequenceClassification

from tidal.checkpoint import save_hf_model
from tidal.config import ConfigError, ModelConfig
from tidal.data.pairs import PairSample, collate_pairs
from tidal.distributed import World
from tidal.models import load_tokenizer
from tidal.models.value_model import load_value_model, reward_config

CPU = torch.device("cpu")
PAIRS = [
    PairSample([1, 40, 41, 42, 3], [1, 40, 41, 3], 2, 0.0),
    PairSample([1, 50, 3], [1, 50, 51, 52, 53, 54, 3], 1, 0.0),
]


def _load(path, prefix="score", **kwargs):
    return load_value_model(ModelConfig(pretrain=str(path)), CPU, prefix, **kwargs).eval()


@torch.no_grad()
def test_values_agree_padded_packed_and_left_padded(tiny_qwen2):
    model = _load(tiny_qwen2)
    padded = collate_pairs(PAIRS, pad_id=0)
    packed = collate_pairs(PAIRS, pad_id=0, packing=True)
    v_pad, v_pack = model.values(padded), model.values(packed)
    assert v_pad.shape == padded["input_ids"].shape and v_pad.dtype == torch.float32
    torch.testing.assert_close(v_pack[0], v_pad[padded["attention_mask"].bool()], atol=1e-5, rtol=0)

    scores = model.scores(padded)
    lengths = padded["attention_mask"].sum(1)
    torch.testing.assert_close(scores, v_pad[torch.arange(4), lengths - 1])
    torch.testing.assert_close(model.scores(packed), scores, atol=1e-5, rtol=0)

    # Left padding (the seed README's inference layout) scores the same last token.
    width = padded["input_ids"].shape[1]
    left = {k: torch.zeros_like(padded[k]) for k in ("input_ids", "attention_mask", "position_ids")}
    for row, n in enumerate(lengths.tolist()):
        for key in left:
            left[key][row, width - n :] = padded[key][row, :n]
    torch.testing.assert_close(model.scores(left), scores, atol=1e-5, rtol=0)


@pytest.mark.parametrize("prefix", ["score", "value_head"])
def test_saved_model_round_trips(tiny_llama, tmp_path, prefix):
    tokenizer = load_tokenizer(str(tiny_llama))
    model = _load(tiny_llama, prefix)
    batch = collate_pairs(PAIRS, tokenizer.pad_token_id)
    with torch.no_grad():
        want = model.scores(batch)
    out = save_hf_model(
        model, tokenizer, tmp_path / prefix, World(), reward_config(model, tokenizer, 0.5, 2.0)
    )
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f"{prefix}.weight" in set(f.keys())

    with torch.no_grad():
        torch.testing.assert_close(_load(out, prefix).scores(batch), want, atol=1e-5, rtol=0)
        normalized = _load(out, prefix, normalize_reward=True).scores(batch)
    torch.testing.assert_close(normalized, (want - 0.5) / 2.0, atol=1e-5, rtol=0)
    if prefix == "score":  # plain HF, pooling at the rightmost non-pad token
        hf = AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
        with torch.no_grad():
            logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        torch.testing.assert_close(logits.squeeze(-1), want, atol=1e-5, rtol=0)
    else:
        with pytest.raises(ConfigError, match="--value_head_prefix value_head"):
            _load(out, "score")


def test_normalize_without_stats_uses_mean_0_std_1_as_openrlhf(tiny_llama, caplog):
    """OpenRLHF keeps mean 0 / std 1 when the config stores none: the scores are unchanged (said once)."""
    with caplog.at_level(logging.INFO, logger="tidal.models.value_model"):
        model = _load(tiny_llama, normalize_reward=True)
    scores = torch.tensor([-1.5, 0.25, 3.0])
    assert torch.equal(model.normalize(scores), scores)
    assert any("stores no reward mean/std" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("prefix", ["score", "value_head"])
def test_lora_trains_adapters_and_head(tiny_llama, prefix):
    cfg = ModelConfig(pretrain=str(tiny_llama), lora_rank=4, lora_alpha=8)
    model = load_value_model(cfg, CPU, prefix)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    heads = [n for n in trainable if "lora_" not in n]
    assert len(heads) == 1 and f".{prefix}." in heads[0], heads
    model.scores(collate_pairs(PAIRS, 0)).sum().backward()
    assert all(
        p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if n in heads
    )


def test_reward_model_without_a_trained_head_is_refused(tiny_llama, tmp_path):
    """A plain causal LM as a reward model would score with a random head: refused, naming the path."""
    with pytest.raises(ConfigError) as info:
        _load(tiny_llama, trained_head=True)
    message = str(info.value)
    assert message == (
        f"{tiny_llama} has no trained value head: its weights have no 'score.weight' (it is a causal LM: "
        "lm_head, no value head), so it would score with a random head; expected a reward model saved by `tidal rm`"
    )


def test_a_head_under_another_name_suggests_the_prefix(tiny_llama, tmp_path):
    tokenizer = load_tokenizer(str(tiny_llama))
    model = _load(tiny_llama, "value_head")
    out = save_hf_model(model, tokenizer, tmp_path / "rm", World(), {"pad_token_id": tokenizer.pad_token_id})
    _load(out, "value_head", trained_head=True)  # its own prefix: loads
    with pytest.raises(
        ConfigError,
        match=r"they have a 'value_head' layer: if that is the head, pass --value_head_prefix value_head$",
    ):
        _load(out, "score", trained_head=True)


def test_critic_from_a_causal_lm_still_gets_a_fresh_head_silently(tiny_llama, caplog):
    """The PPO critic (and a reward model about to be trained) starts from the policy: no error."""
    model = _load(tiny_llama)
    assert model.score.weight.shape[0] == 1
    assert not [
        r for r in caplog.records if r.name.startswith("tidal") and r.levelname in ("WARNING", "ERROR")
    ]


def test_ppo_refuses_a_causal_lm_as_reward_model(tiny_llama, tmp_path, capsys):
    from tidal.cli.train_ppo import main as ppo_main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1>"}\n{"prompt": "2>"}\n')
    argv = ["--pretrain", str(tiny_llama), "--reward_pretrain", str(tiny_llama), "--prompt_data", str(prompts),
            "--input_key", "prompt", "--rollout_batch_size", "2", "--train_batch_size", "2",
            "--micro_train_batch_size", "2", "--generate_max_len", "2", "--save_path", str(tmp_path / "out")]  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        ppo_main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    assert f"{tiny_llama} has no trained value head" in err
    assert not (tmp_path / "out").exists()
