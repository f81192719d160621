"""RL trainer behaviour on CPU: estimators learn, updates are batch-invariant, resume is exact, and
the seed's commands and user files (reward functions, agents, reward servers) work end to end."""

from __future__ import annotations

import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from tidal.cli.train_ppo import main as ppo_main
from tidal.cli.train_ppo import parse_run
from tidal.cli.train_sft import parse_run as parse_sft
from tidal.experience.experience import Experience
from tidal.trainers.ppo import run_ppo
from tidal.trainers.ppo import trainer as trainer_module
from tidal.trainers.sft import run_sft

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def write_echo_data(d: Path) -> Path:
    """'7>' → '7': SFT answers are right only half the time, so RL has a clear signal to follow."""
    d.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    with (d / "sft.jsonl").open("w") as f:
        for _ in range(1024):
            x = rng.randint(0, 9)
            answer = x if rng.random() < 0.5 else rng.choice([y for y in range(10) if y != x])
            f.write(json.dumps({"prompt": f"{x}>", "answer": str(answer), "label": str(x)}) + "\n")
    with (d / "prompts.jsonl").open("w") as f:
        for i in range(512):
            f.write(json.dumps({"prompt": f"{i % 10}>", "label": str(i % 10)}) + "\n")
    return d


@pytest.fixture(scope="module")
def echo_data(tmp_path_factory):
    return write_echo_data(tmp_path_factory.mktemp("echo"))


@pytest.fixture(scope="module")
def echo_policy(tiny_qwen2, echo_data):
    out = echo_data / "sft_model"
    run_sft(parse_sft([
        "--pretrain", str(tiny_qwen2), "--dataset", str(echo_data / "sft.jsonl"), "--input_key", "prompt",
        "--output_key", "answer", "--max_len", "16", "--train_batch_size", "32", "--micro_train_batch_size", "32",
        "--packing_samples", "--max_epochs", "2", "--learning_rate", "3e-3", "--save_path", str(out),
        "--input_template", "{}",  # RL prompts are raw: SFT on them untemplated
    ]))  # fmt: skip
    return out


def rl_flags(policy, data, out, *extra):
    return [
        "--pretrain", str(policy), "--prompt_data", str(data / "prompts.jsonl"), "--input_key", "prompt",
        "--label_key", "label", "--remote_rm_url", str(EXAMPLES / "reward_func.py"),
        "--n_samples_per_prompt", "8", "--rollout_batch_size", "16", "--train_batch_size", "128",
        "--micro_train_batch_size", "64", "--micro_rollout_batch_size", "64", "--generate_max_len", "4",
        "--prompt_max_len", "8", "--actor_learning_rate", "1e-3", "--lr_warmup_ratio", "0", "--init_kl_coef", "0",
        "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"), "--seed", "3", "--max_samples", "160",
        *extra,
    ]  # fmt: skip


def scores(history):
    return [h["score"] for h in history]


def assert_learns(history, gain=0.2):
    s = scores(history)
    first, last = sum(s[:2]) / 2, sum(s[-2:]) / 2
    assert last > first + gain, s


def test_grpo_raises_reward(echo_policy, echo_data, tmp_path):
    history = run_ppo(
        parse_run(rl_flags(echo_policy, echo_data, tmp_path, "--advantage_estimator", "group_norm"))
    )
    assert len(history) == 10
    assert_learns(history)
    assert (tmp_path / "final" / "model.safetensors").exists()


def test_ppo_with_gae_and_critic_raises_reward(echo_policy, echo_data, tmp_path):
    history = run_ppo(parse_run(rl_flags(
        echo_policy, echo_data, tmp_path, "--advantage_estimator", "gae", "--n_samples_per_prompt", "4",
        "--rollout_batch_size", "32", "--critic_learning_rate", "1e-3", "--init_kl_coef", "0.01",
        "--save_value_network", "--max_samples", "320",
    )))  # fmt: skip
    assert all("critic/loss" in h and "kl" in h for h in history)
    assert_learns(history, gain=0.15)
    from transformers import AutoModelForSequenceClassification

    critic = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "final") + "_critic")
    assert critic.config.num_labels == 1


@pytest.mark.parametrize("estimator", ["reinforce_baseline", "rloo"])
def test_baseline_estimators_move_reward_up(echo_policy, echo_data, tmp_path, estimator):
    history = run_ppo(
        parse_run(rl_flags(echo_policy, echo_data, tmp_path, "--advantage_estimator", estimator))
    )
    assert_learns(history, gain=0.1)


def _experience(n=8, width=12, seed=0) -> Experience:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, width + 1, (n,), generator=g)
    attn = (torch.arange(width)[None] < lengths[:, None]).long()
    action = attn.clone()
    action[:, :3] = 0  # three prompt tokens
    seq = torch.randint(5, 500, (n, width), generator=g) * attn
    zeros = torch.zeros(n, width)
    return Experience(seq, attn, action, zeros, rewards=torch.zeros(n), scores=torch.zeros(n),
                      advantages=torch.randn(n, width, generator=g) * action)  # fmt: skip


def test_policy_update_does_not_depend_on_micro_batching_or_packing(tiny_llama):
    from tidal.config import ModelConfig
    from tidal.config.rl import AlgorithmConfig
    from tidal.distributed import World
    from tidal.experience.maker import forward_logprobs
    from tidal.models import Precision, load_causal_lm
    from tidal.trainers.ppo.update import Normaliser, PolicyLoss

    model = load_causal_lm(ModelConfig(pretrain=str(tiny_llama)), torch.device("cpu"))
    precision = Precision.create("fp32", torch.device("cpu"))
    exp = _experience()
    exp.old_logprobs = forward_logprobs(model, exp, 8, False, 1.0, precision) - 0.05  # ratios ≠ 1
    cfg = AlgorithmConfig(entropy_loss_coef=0.01)
    grads = {}
    for micro, packing in [(8, False), (3, False), (2, True)]:
        loss_fn = PolicyLoss(cfg, precision, 1.0, packing)
        norm = Normaliser.of(exp, World())
        model.zero_grad()
        for start in range(0, len(exp), micro):
            loss, _ = loss_fn(model, exp.select(list(range(start, min(start + micro, len(exp))))), norm)
            loss.backward()
        grads[(micro, packing)] = torch.cat(
            [p.grad.flatten() for p in model.parameters() if p.grad is not None]
        )
    ref = grads[(8, False)]
    assert ref.abs().max() > 1e-4
    for key, g in grads.items():
        torch.testing.assert_close(g, ref, atol=1e-6, rtol=1e-4, msg=str(key))


def test_resume_continues_identically(echo_policy, echo_data, tmp_path, crash_after):
    common = ["--advantage_estimator", "group_norm", "--save_steps", "2", "--max_samples", "96"]
    full = run_ppo(parse_run(rl_flags(echo_policy, echo_data, tmp_path / "full", *common)))
    assert len(full) == 6

    restore = crash_after(trainer_module.PPOTrainer, "update", 3)
    with pytest.raises(KeyboardInterrupt):
        run_ppo(parse_run(rl_flags(echo_policy, echo_data, tmp_path / "cut", *common)))
    restore()
    resumed = run_ppo(
        parse_run(rl_flags(echo_policy, echo_data, tmp_path / "cut", *common, "--load_checkpoint"))
    )
    assert [h["step"] for h in resumed] == [3, 4, 5, 6]
    for a, b in zip(full[2:], resumed, strict=True):
        assert a["score"] == b["score"] and a["policy/loss"] == pytest.approx(b["policy/loss"], abs=1e-6)


def test_multi_turn_agent_trains_on_action_tokens_only(echo_policy, echo_data, tmp_path, monkeypatch):
    seen = []
    original = trainer_module.PPOTrainer.make_experience

    def spy(self, exp):
        seen.append(exp)
        return original(self, exp)

    monkeypatch.setattr(trainer_module.PPOTrainer, "make_experience", spy)
    flags = rl_flags(echo_policy, echo_data, tmp_path, "--advantage_estimator", "reinforce_baseline",
                     "--agent_func_path", str(EXAMPLES / "agent_func.py"), "--max_samples", "32")  # fmt: skip
    flags.remove("--remote_rm_url")
    flags.remove(str(EXAMPLES / "reward_func.py"))
    history = run_ppo(parse_run(flags))
    assert len(history) == 2
    exp = seen[0]
    # Feedback tokens sit between actions: somewhere an action token follows a non-action, non-prompt token.
    acted = exp.action_mask.bool()
    gaps = (~acted[:, 1:]) & acted[:, :-1] & exp.attention_mask[:, 1:].bool()
    assert gaps.any(), "expected environment feedback after a first action"


class _RewardHandler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        rewards = [
            1.0 if q.endswith(str(lbl)) else 0.0 for q, lbl in zip(body["query"], body["labels"], strict=True)
        ]
        out = json.dumps({"rewards": rewards, "scores": rewards, "extra_logs": {"served": 1.0}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


def test_remote_reward_server_url(echo_policy, echo_data, tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RewardHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/get_reward"
        flags = rl_flags(
            echo_policy, echo_data, tmp_path, "--advantage_estimator", "group_norm", "--max_samples", "16"
        )
        flags[flags.index("--remote_rm_url") + 1] = url
        history = run_ppo(parse_run(flags))
    finally:
        server.shutdown()
    assert history[0]["served"] == 1.0


@pytest.fixture(scope="module")
def echo_reward_model(tiny_qwen2, echo_data):
    """A reward model trained with ``tidal rm --normalize_reward`` (so it stores reward mean/std)."""
    from tidal.cli.train_rm import main as rm_main

    with (echo_data / "pairs.jsonl").open("w") as f:
        for i in range(64):
            x = i % 10
            f.write(json.dumps({"prompt": f"{x}>", "chosen": str(x), "rejected": str((x + 3) % 10)}) + "\n")
    out = echo_data / "rm"
    rm_main([
        "--pretrain", str(tiny_qwen2), "--dataset", str(echo_data / "pairs.jsonl"), "--prompt_key", "prompt",
        "--train_batch_size", "16", "--micro_train_batch_size", "16", "--max_len", "16", "--learning_rate", "1e-3",
        "--normalize_reward", "--save_path", str(out),
    ])  # fmt: skip
    return out


def test_seed_hybrid_engine_command_runs(echo_policy, echo_reward_model, echo_data, tmp_path):
    """The seed README's PPO command with only model paths, sizes and the module name changed: the
    device counts (8 GPUs per role, 4 engines of tensor-parallel size 2) become 1 for this one device
    (local mode); larger counts start that many Ray workers (tests/distributed/test_ray.py)."""
    ppo_main([
        "--ref_num_nodes", "1", "--ref_num_gpus_per_node", "1", "--reward_num_nodes", "1",
        "--reward_num_gpus_per_node", "1", "--critic_num_nodes", "1", "--critic_num_gpus_per_node", "1",
        "--actor_num_nodes", "1", "--actor_num_gpus_per_node", "1", "--vllm_num_engines", "1",
        "--vllm_tensor_parallel_size", "1", "--colocate_all_models", "--vllm_gpu_memory_utilization", "0.5",
        "--pretrain", str(echo_policy), "--reward_pretrain", str(echo_reward_model),
        "--save_path", str(tmp_path / "final"), "--ckpt_path", str(tmp_path / "ckpt"), "--save_hf_ckpt",
        "--train_batch_size", "8", "--rollout_batch_size", "8", "--use_dynamic_batch",
        "--n_samples_per_prompt", "1", "--max_epochs", "1", "--prompt_max_len", "8", "--max_samples", "8",
        "--generate_max_len", "4", "--zero_stage", "3", "--param_dtype", "bf16", "--actor_learning_rate", "5e-7",
        "--critic_learning_rate", "9e-6", "--init_kl_coef", "0.01", "--prompt_data", str(echo_data / "prompts.jsonl"),
        "--input_key", "prompt", "--normalize_reward", "--gradient_checkpointing", "--packing_samples",
        "--vllm_sync_backend", "nccl", "--enforce_eager", "--vllm_enable_sleep", "--deepspeed_enable_sleep",
        "--use_wandb", "offline",
    ])  # fmt: skip
    assert (tmp_path / "final" / "model.safetensors").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--advantage_estimator", "rloo", "--n_samples_per_prompt", "1", "--train_batch_size", "16"],
            "n_samples_per_prompt",
        ),
        (["--dual_clip", "0.5"], "--dual_clip"),
        (["--use_icepop"], "--enable_vllm_is_correction"),
        (["--remote_rm_url", "not-a-url"], "--remote_rm_url"),
        (["--vllm_sync_with_ray"], "--vllm_sync_with_ray"),
    ],
)
def test_bad_flags_fail_clearly(echo_policy, echo_data, tmp_path, capsys, extra, message):
    flags = rl_flags(echo_policy, echo_data, tmp_path, "--advantage_estimator", "group_norm")
    if "--remote_rm_url" in extra:
        i = flags.index("--remote_rm_url")
        del flags[i : i + 2]
    with pytest.raises(SystemExit) as exc:
        ppo_main(flags + extra)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_async_training_learns(echo_policy, echo_data, tmp_path):
    history = run_ppo(parse_run(rl_flags(
        echo_policy, echo_data, tmp_path, "--advantage_estimator", "group_norm", "--async_train",
        "--async_queue_size", "1", "--enable_vllm_is_correction",
    )))  # fmt: skip
    assert len(history) == 10
    assert_learns(history, gain=0.15)


def test_vllm_flags_configure_the_engine(echo_policy, echo_data, tmp_path):
    from tidal.placement.rollout import LocalRollout

    run = parse_run(rl_flags(echo_policy, echo_data, tmp_path, "--advantage_estimator", "group_norm",
                             "--enforce_eager", "--vllm_gpu_memory_utilization", "0.3",
                             "--vllm_generate_batch_size", "24", "--async_train"))  # fmt: skip
    from tidal.models import load_tokenizer

    tok = load_tokenizer(str(echo_policy))
    rollout = LocalRollout(str(echo_policy), tok, run.rollout, run.agent, torch.device("cpu"), tok.pad_token_id,
                           False, 0)  # fmt: skip
    cfg = rollout.engine.config
    # --vllm_generate_batch_size 24 is the prompts of a generation call, not the engine's max_num_seqs
    assert cfg.enforce_eager and cfg.gpu_memory_utilization == 0.3 and cfg.max_num_seqs == 256
