"""``examples/tool_agent_func.py`` trains: ``tidal ppo`` (GRPO) with the calculator agent raises the share of
episodes whose tool call the executor runs before the model answers.

A tiny random model learns no arithmetic, so what RL can teach it here is to use the tool: after a short
SFT on the example's demonstrations (half call ``multiply``, half guess), a sampled first message is a
call about half the time, often malformed. The example's reward adds ``TOOL_CALL_REWARD`` to an episode
that answered after calls that ran (and 1.0 for the right product, which a guess almost never is), so
the share of such episodes, ``(reward - score) / TOOL_CALL_REWARD``, must rise over 8 GRPO steps.
A call that does not parse, names another tool or has bad arguments ends its episode with 0; and every
trained episode with a call is checked to hold, right after it, the tool message with the product of
the call's own arguments: the calls were executed and their results are what the model read next.

The tokenizer is tidal.testing's tiny one plus a few added tokens: ``<tool_call>`` and ``</tool_call>``
(single tokens in Qwen2.5's vocabulary too) and the fixed parts of the compact call JSON, standing in
for a pretrained model that already writes JSON; the call is then about ten tokens, which a 2-layer
model learns to write in a few dozen SFT steps.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tidal.cli.train_ppo import parse_run
from tidal.cli.train_sft import parse_run as parse_sft
from tidal.testing.tiny import build_tiny_tokenizer, tiny_config
from tidal.trainers.ppo import run_ppo
from tidal.trainers.sft import run_sft

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tool_agent_func.py"
CALL_TOKENS = ["<tool_call>", "</tool_call>", '{"name":"multiply","arguments":{"a":', ',"b":', "}}"]


def load_example():
    spec = importlib.util.spec_from_file_location("tool_agent_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_model(path: Path) -> Path:
    """A 2-layer Qwen2 with tidal.testing's tokenizer and the call's added tokens (about 0.3M parameters)."""
    from transformers import AutoModelForCausalLM

    tokenizer = build_tiny_tokenizer(path, add_bos=False)
    tokenizer.add_tokens(CALL_TOKENS)
    tokenizer.save_pretrained(str(path))
    config = tiny_config(
        "qwen2",
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(path))
    return path


def tool_use_share(history: list[dict], bonus: float) -> list[float]:
    """Per step, the share of episodes that answered after tool calls that ran."""
    return [(h["reward"] - h["score"]) / bonus for h in history]


def executed_calls(trajectories, tokenizer) -> int:
    """Episodes that called ``multiply`` and then answered; fails on a call not followed by the tool
    message holding its result for the call's arguments."""
    from tidal.agents import parse_tool_calls

    count = 0
    for traj in trajectories:
        text = tokenizer.decode(traj.token_ids[traj.prompt_len :], skip_special_tokens=False)
        if traj.error is not None or "<tool_call>" not in text:
            continue
        first_message = text.split("<|im_end|>")[0]
        [(name, arguments)] = parse_tool_calls(first_message, "hermes").calls
        result = f"<|im_end|>\n<|im_start|>tool\n{arguments['a'] * arguments['b']}<|im_end|>"
        assert name == "multiply" and text.startswith(first_message + result), text
        count += "<tool_call>" not in text[len(first_message + result) :]  # answered (a 2nd call did not)
    return count


def test_grpo_teaches_the_calculator_agent_to_use_its_tool(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from tidal.experience import scoring as scoring_module

    rollouts = []  # each step's trajectories, as the trainer turns them into tensors
    original = scoring_module.from_trajectories

    def spy(trajectories, pad_id):
        rollouts.append(list(trajectories))
        return original(trajectories, pad_id)

    monkeypatch.setattr(scoring_module, "from_trajectories", spy)
    example = load_example()
    assert example.TOOL_CALL_REWARD > 0
    data = example.write_data(tmp_path / "data", n_sft=512, n_prompts=64, operands=(10, 99))
    model = build_model(tmp_path / "base")
    run_sft(parse_sft([
        "--pretrain", str(model), "--dataset", str(data / "sft.jsonl"), "--input_key", "prompt",
        "--output_key", "answer", "--input_template", "{}", "--max_len", "64", "--train_batch_size", "32",
        "--micro_train_batch_size", "32", "--max_epochs", "6", "--learning_rate", "5e-3",
        "--lr_scheduler", "constant", "--lr_warmup_ratio", "0", "--seed", "0", "--save_path", str(tmp_path / "sft"),
    ]))  # fmt: skip
    history = run_ppo(parse_run([
        "--pretrain", str(tmp_path / "sft"), "--prompt_data", str(data / "prompts.jsonl"), "--input_key", "prompt",
        "--label_key", "label", "--agent_func_path", str(EXAMPLE), "--advantage_estimator", "group_norm",
        "--n_samples_per_prompt", "8", "--rollout_batch_size", "8", "--train_batch_size", "64",
        "--micro_train_batch_size", "64", "--micro_rollout_batch_size", "64", "--generate_max_len", "16",
        "--prompt_max_len", "32", "--actor_learning_rate", "1e-3", "--lr_warmup_ratio", "0", "--init_kl_coef", "0",
        "--seed", "3", "--save_path", str(tmp_path / "rl"), "--ckpt_path", str(tmp_path / "ckpt"),
    ]))  # fmt: skip
    assert len(history) == 8
    # Step 1's episodes are sampled before any update: the SFT policy. Over 7 (SFT, RL) seed pairs, these
    # included (0.16 -> 0.76), the share went from 0.16-0.55 there to 0.76-0.91 over the last three steps
    # (gains 0.22-0.60).
    share = tool_use_share(history, example.TOOL_CALL_REWARD)
    assert sum(share[-3:]) / 3 > share[0] + 0.15, share
    # Episodes that called the tool answered on the second turn, after the tool's message.
    assert history[-1]["agent/tool_calls"] > history[0]["agent/tool_calls"]
    assert all(h["agent/turns"] == pytest.approx(1 + h["agent/tool_calls"]) for h in history)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    executed = [executed_calls(trajectories, tokenizer) / len(trajectories) for trajectories in rollouts]
    assert executed == pytest.approx(share, abs=1e-6)
