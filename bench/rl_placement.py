r"""Benchmark: GRPO with the real trainer (``tidal ppo``) under different placements, timed by phase.

Builds a random-init model folder (``--config``: ``tiny`` on the CPU, ``qwen2.5-0.5b`` on GPUs, with
``tidal.testing``'s tokenizer), a prompt file of ``--prompts x --rollouts`` digit strings of
``--prompt_len`` tokens and a trivial reward function, then runs ``python -m tidal.cli.train_ppo``
once per variant and reads the phases it logs (``time/*`` in ``<save_path>/run/metrics.jsonl``):

- ``local``: one process, policy and engine share device 0 (the default; a reference);
- ``separate``: one trainer on device 0 and ``--vllm_num_engines 1`` on device 1, weights by
  bucketed NCCL broadcast (gloo between CPU processes);
- ``separate_async``: the same with ``--async_train``: the engine generates the next rollout while
  the trainer trains, so a step costs about max(generate, train) instead of their sum;
- ``colocated``: ``torchrun --nproc_per_node 2 --colocate_all_models``: two data-parallel workers,
  each with its policy shard (FSDP2) and its own engine on the same device;
- ``colocated_tp2``: the same with ``--vllm_tensor_parallel_size 2 --vllm_enable_sleep``: one engine
  spanning both workers' devices, each holding half of it (the workers generate their shares in turn),
  its KV cache freed while the policy trains (``--trainer_sleep`` adds ``--deepspeed_enable_sleep`` to
  the colocated variants: the trainer's weights and optimizer state go to host memory while the engine
  generates).

Phases: ``generate`` (engine + reward), ``make_experience`` (old log-probs, advantages),
``train`` (the update), ``sync_weights``, and the step's wall time ``time/step`` (with
``--async_train`` less than their sum). Prints one JSON line with the medians over the steps after
the first (which captures CUDA graphs) and tokens/s = (prompt + response tokens) per step / step
time / devices, and the peak device memory of each rank (``peak_gb_per_rank``: the largest
``memory/peak_gb_rank<i>`` the trainer logs per step on CUDA, first step included; absent on the CPU).

    python bench/rl_placement.py                                       # tiny, CPU processes, ~1 min
    python bench/rl_placement.py --device cuda --config qwen2.5-0.5b [--compile]   # 2 GPUs

Issue #16's Qwen2.5-7B-shaped GRPO step on 2 H200s (FSDP2 over 2 workers, one TP=2 engine colocated with
them). Memory: 7.6B parameters x (4 float32 master + 8 Adam + 4 gradient bytes) / 2 ranks = 61 GB per
rank, the gathered bf16 weights between forward and backward (``--zero_stage 2``) 15 GB, the engine's
half of the bf16 weights 7.6 GB, activations under gradient checkpointing of 8 x 768-token packed
micro-batches a few GB; the KV cache is freed while training. About 90 GB of 141: no trainer sleep
needed (``--trainer_sleep`` if it runs short). The model folder (bf16, 15 GB) is built once on GPU 0,
in a child process so that no CUDA context of this process stays behind:

    python bench/rl_placement.py --device cuda --config qwen2.5-7b --variants colocated_tp2 \
        --prompts 32 --n 8 --prompt_len 256 --new_tokens 512 --micro 8 --rollouts 3 --timeout_s 450

(``--timeout_s``: a run still going then, e.g. in the final export of the 30 GB float32 model, is killed and
the steps it logged are reported, the first one left out as always.)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import random
import signal
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import COMMON, CONFIGS, versions  # noqa: E402

PHASES = ("generate", "make_experience", "train", "sync_weights")
REWARD = '''
import torch


def reward_func(queries, prompts, labels, **kwargs):
    """Trivial and cheap: the response length modulo 7."""
    return {"rewards": torch.tensor([len(q) - len(p) for q, p in zip(queries, prompts)]).remainder(7) / 7}
'''
VARIANTS = {
    "local": (1, ["--colocate_all_models"]),
    "separate": (1, ["--vllm_num_engines", "1"]),
    "separate_async": (1, ["--vllm_num_engines", "1", "--async_train"]),
    "colocated": (2, ["--colocate_all_models"]),
    "colocated_tp2": (
        2,
        ["--colocate_all_models", "--vllm_tensor_parallel_size", "2", "--vllm_enable_sleep"],
    ),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny", choices=sorted(CONFIGS))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    default = ["local", "separate", "separate_async", "colocated"]
    p.add_argument("--variants", nargs="+", default=default, choices=list(VARIANTS))
    p.add_argument("--prompts", type=int, default=32, help="prompts per rollout")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--micro", type=int, default=64, help="samples per micro-batch (scoring and update)")
    p.add_argument("--rollouts", type=int, default=4)
    p.add_argument("--compile", action="store_true", help="pass --torch_compile to every run")
    p.add_argument("--trainer_sleep", action="store_true",
                   help="pass --deepspeed_enable_sleep to the colocated variants (those with --colocate_all_models)")  # fmt: skip
    p.add_argument("--folder", default="/tmp/tidal_rl_placement")
    p.add_argument("--timeout_s", type=float, default=0.0,
                   help="stop a variant's run after this long and report the steps it logged (0: no limit)")  # fmt: skip
    args = p.parse_args(argv)
    if args.config == "tiny" and args.new_tokens == 256:
        args.prompts, args.n, args.prompt_len, args.new_tokens, args.micro = 4, 4, 16, 16, 8
    return args


def build_model(name: str, folder: Path, device: str = "cpu") -> Path:
    """A random-init model of ``CONFIGS[name]``'s shape with tidal.testing's tokenizer (ids beyond the
    tokenizer's vocabulary decode to nothing, which the trivial reward does not mind). On CUDA it is
    initialised on the GPU and saved in bf16 (the trainer loads float32 master weights from it, the
    engine bf16): a 7B initialises in seconds and its folder is 15 GB, not 30. Call it in a child process
    (``build_model_in_child``) so that the CUDA context does not stay on GPU 0 during the runs."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tidal.testing.tiny import build_tiny_tokenizer

    if (folder / "config.json").exists():
        return folder
    tokenizer = build_tiny_tokenizer(folder, add_bos=False)
    fields = dict(COMMON, **CONFIGS[name])
    fields.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(str(folder))
    return folder


def build_model_in_child(name: str, folder: Path, device: str) -> Path:
    """``build_model`` in a fresh (spawned) process."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(build_model, name, folder, device).result()


def write_data(args, folder: Path) -> None:
    rng = random.Random(0)
    with (folder / "prompts.jsonl").open("w") as f:
        for _ in range(args.prompts * args.rollouts):
            digits = "".join(rng.choice("0123456789") for _ in range(args.prompt_len))  # one token each
            f.write(json.dumps({"prompt": digits}) + "\n")
    (folder / "reward.py").write_text(REWARD)


def flags(args, model: Path, folder: Path, out: Path) -> list[str]:
    return [
        "--pretrain", str(model), "--prompt_data", str(folder / "prompts.jsonl"), "--input_key", "prompt",
        "--remote_rm_url", str(folder / "reward.py"), "--advantage_estimator", "group_norm", "--init_kl_coef", "0",
        "--n_samples_per_prompt", str(args.n), "--rollout_batch_size", str(args.prompts),
        "--train_batch_size", str(args.prompts * args.n), "--micro_train_batch_size", str(args.micro),
        "--micro_rollout_batch_size", str(args.micro), "--prompt_max_len", str(args.prompt_len + 8),
        "--generate_max_len", str(args.new_tokens), "--packing_samples", "--gradient_checkpointing",
        "--actor_learning_rate", "1e-6", "--lr_warmup_ratio", "0", "--zero_stage", "2",
        "--param_dtype", "bf16" if args.device == "cuda" else "fp32", "--vllm_gpu_memory_utilization", "0.3",
        "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"), "--logging_steps", "1",
        *(["--torch_compile"] if args.compile else []),
    ]  # fmt: skip


def variant_flags(args, name: str) -> list[str]:
    """The variant's own flags, plus ``--deepspeed_enable_sleep`` on colocated ones under ``--trainer_sleep``."""
    extra = list(VARIANTS[name][1])
    if args.trainer_sleep and "--colocate_all_models" in extra:
        extra.append("--deepspeed_enable_sleep")
    return extra


def peak_memory(steps: list[dict]) -> list[float] | None:
    """Each rank's largest ``memory/peak_gb_rank<i>`` over ``steps`` (the trainer logs it on CUDA), or None."""
    ranks = sorted(int(k.rsplit("rank", 1)[1]) for k in steps[0] if k.startswith("train/memory/peak_gb_rank"))
    if not ranks:
        return None
    return [max(s[f"train/memory/peak_gb_rank{r}"] for s in steps) for r in ranks]


def run_variant(args, name: str, model: Path, folder: Path) -> dict:
    processes, extra = VARIANTS[name][0], variant_flags(args, name)
    out = folder / name
    launcher = [sys.executable]
    if processes > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    cmd = launcher + ["-m", "tidal.cli.train_ppo"] + flags(args, model, folder, out) + extra
    env = dict(os.environ, OMP_NUM_THREADS="1")
    print(f"# {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    metrics = out / "final" / "run" / "metrics.jsonl"
    metrics.unlink(missing_ok=True)  # a file from an earlier run is not this run's
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        _, err = proc.communicate(timeout=args.timeout_s or None)
        timed_out = False
    except subprocess.TimeoutExpired:  # keep the steps it logged (one line each, on disk as written)
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers: a process group of their own
        _, err = proc.communicate()
        timed_out = True
    steps = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    if (proc.returncode and not timed_out) or len(steps) < 2:
        sys.stderr.write(err[-6000:])
        why = f"timed out after {args.timeout_s} s" if timed_out else f"exit {proc.returncode}"
        return {"error": why, "steps_logged": len(steps)}
    timed = steps[1:]  # the first step captures CUDA graphs
    phases = {p: round(statistics.median(s[f"train/time/{p}"] for s in timed), 3) for p in PHASES}
    step_s = statistics.median(s["train/time/step"] for s in timed)  # wall: async generation overlaps
    devices = 2 if name.startswith("separate") else processes
    tokens = args.prompts * args.n * (args.prompt_len + args.new_tokens)
    result = {"phases_s": phases, "step_s": round(step_s, 3), "devices": devices,
              "tokens_per_s_per_device": round(tokens / step_s / devices), "reward": timed[-1]["train/reward"],
              "peak_gb_per_rank": peak_memory(steps), "timed_steps": len(timed)}  # fmt: skip
    if timed_out:
        result["timed_out_after_s"] = args.timeout_s
    print(f"# {name}: {result}", file=sys.stderr, flush=True)
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = build_model_in_child(args.config, folder / f"model-{args.config}", args.device)
    write_data(args, folder)
    results = {name: run_variant(args, name, model, folder) for name in args.variants}
    report = {"bench": "rl_placement", **versions(), "device": args.device, "config": args.config,
              "compile": args.compile, "trainer_sleep": args.trainer_sleep, "prompts": args.prompts, "n": args.n, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "variants": results}  # fmt: skip
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
