"""A tiny ``tidal ppo`` run's log names every phase it goes through, start-up included: the memory plan,
loading the policy and the reference, the engine's weights and KV cache, generation with its request count, the scoring
and training micro-batches, the engine's sleep and wake, and the weight sync (issue #39). No timings are
asserted: only that each phase is named."""

from __future__ import annotations

import json
import logging

from tidal.cli.train_ppo import main as ppo_main
from tidal.trainers.ppo.memory_check import CAPACITY_ENV


def test_every_phase_is_named_in_the_log(tiny_qwen2, tmp_path, monkeypatch, caplog):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}>", "label": str(i)}) + "\n" for i in range(8)))
    reward = tmp_path / "reward.py"
    reward.write_text("import torch\n\ndef reward_func(queries, prompts, labels, **kw):\n"
                      "    return {'rewards': torch.rand(len(queries))}\n")  # fmt: skip
    monkeypatch.setenv(CAPACITY_ENV, "80")  # a make-believe 80 GiB device: the plan runs on the CPU too
    caplog.set_level(logging.INFO)
    ppo_main([
        "--pretrain", str(tiny_qwen2), "--prompt_data", str(prompts), "--input_key", "prompt",
        "--remote_rm_url", str(reward), "--n_samples_per_prompt", "2", "--rollout_batch_size", "4",
        "--train_batch_size", "4", "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "4",
        "--generate_max_len", "4", "--prompt_max_len", "8", "--init_kl_coef", "0.01",
        "--advantage_estimator", "group_norm", "--vllm_enable_sleep", "--save_path", str(tmp_path / "out"),
    ])  # fmt: skip
    log = "\n".join(r.getMessage() for r in caplog.records)
    for named in (
        "memory plan: peak in the",
        f"loading {tiny_qwen2} (1 file, ",
        f"reference model: {tiny_qwen2} ...",
        "engine: loading weights (torch.float32) onto cpu ...",
        "engine: KV cache of ",
        "generation: 4/4 requests in ",  # two rollouts of 4 prompts
        "make experience: log-probs: 2/2 micro-batches",  # 8 samples, 4 a micro-batch
        "training (PolicyLoss, 2 optimizer steps): 4/4 micro-batches",
        "engine: sleeping (level 1: frees the KV cache, ",
        "engine: waking up (KV cache, ",
        "engine: weights updated, ",
    ):
        assert named in log, f"{named!r} not in the log:\n{log}"
