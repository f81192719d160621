"""Benchmark: GRPO on a 7B-shaped policy on one GPU through ``tidal ppo`` itself (issue #39).

The workload is the issue's: a random-init Qwen2.5-7B-shaped checkpoint (28 layers, hidden 3584, vocab
152064, 28 heads, 4 KV heads), 32 prompts x 8 samples a rollout, ~64-token prompts, 256 new tokens
(a random-init model hardly ever samples its EOS, so responses run to the limit), and the issue's flags:
``--colocate_all_models --vllm_enable_sleep --deepspeed_enable_sleep --gradient_checkpointing
--param_dtype bf16 --micro_train_batch_size 8 --micro_rollout_batch_size 256``, GRPO (``group_norm``)
without a reference (``--init_kl_coef 0``), one optimizer step per rollout. Full-parameter training adds
``--master_dtype bf16`` (bf16 weights, gradients and AdamW moments, 8 bytes a parameter, as TRL with a bf16
model), which tidal's memory plan (``tidal/trainers/ppo/memory_plan.py``) asks for on a 141 GB H200 with a
128 GiB host (float32 state does not fit the GPU, nor with ``--adam_offload`` the host); ``lora`` trains
``--lora_rank 64`` adapters instead.

Each mode runs in a process of its own (the GPU starts empty) and runs ``--steps`` + 1 rollouts; the
first is the warm-up (CUDA graphs captured, kernels compiled) and is reported apart. The JSON line has,
per mode, the median step time split by phase (the trainer's ``time/*`` metrics: generate, wake
(``--deepspeed_enable_sleep`` brings the trainer's state back to the device), make experience, advantages,
train, sync weights, sleep (the state back to host memory)), the start-up time (process start to the first step), and
tokens per second: generated tokens / step time, trained tokens (prompt + response) / step time (the
headline ``tokens_per_s``, docs/architecture.md section 6's definition; the issue's target is >= 3,000), and
both added (``generated_plus_trained_tokens_per_s``).

``--config qwen3.5-0.8b`` (issue #31) runs the same workload on Qwen3.5's smallest released shape
(``bench/family_shapes.py``; ``tiny-qwen3.5`` is its CPU smoke run), full parameters with float32 master
weights (the memory plan asks for ``--master_dtype bf16`` only at 7B). Hybrid models (Gated DeltaNet layers) run each
side twice, ``--fla off on``: with flash-linear-attention unimportable in the process (transformers'
Gated DeltaNet forward/backward then takes its torch fallback, as for a user without ``fla``) and with it
(transformers' fast path; causal-conv1d has no pure-Python wheel, so the convolution stays torch's in
both). The JSON records the path the trainer's model took (``hf_kernels``); tidal's engine runs its own
torch kernels unless ``TIDAL_FLA=1`` is set in the environment (``engine_fla``).

TRL's ``GRPOTrainer`` runs the same workload (same checkpoint, prompts, reward, batch, lengths, gradient
checkpointing, bf16) in a process of its own when ``trl`` is installed; otherwise, or when it fails (out of
memory included), the JSON says why it was skipped. TRL trains bf16 weights with bf16 AdamW moments and
generates with ``transformers.generate`` (no vLLM on these machines); tidal keeps float32 master weights.

    python bench/grpo_7b.py --device cuda                       # full and lora, then TRL
    python bench/grpo_7b.py --device cuda --modes lora --steps 3
    python bench/grpo_7b.py --config tiny --steps 1             # CPU smoke run (< 1 minute)
    python bench/grpo_7b.py --device cuda --config qwen3.5-0.8b --modes full --steps 1
    python bench/grpo_7b.py --config tiny-qwen3.5 --modes full --steps 1   # CPU smoke run
    python bench/grpo_7b.py --device cuda --config qwen2.5-vl-3b --modes full --steps 2
    python bench/grpo_7b.py --config tiny-qwen2.5-vl --modes full --steps 1  # CPU smoke run (tidal's side)

Vision-language workloads (issue #32; ``bench/vlm_shapes.py``: ``qwen2.5-vl-3b``, ``qwen2.5-vl-7b``,
``qwen3-vl-8b``, and ``tiny-qwen2.5-vl`` for CPU smoke runs): a random-init bf16 checkpoint of the released
shape with its image processor files, 8 prompts x 8 samples a rollout (64 samples, as
``bench/vlm_rollout.py``'s batch), each prompt a chat turn of one seeded synthetic 448x448 image (256 image
tokens for Qwen2.5-VL, 196 for Qwen3-VL) then ~64 text tokens. tidal reads the JSONL's image paths
(``--apply_chat_template --max_images_per_prompt 1``); TRL's GRPOTrainer gets the same conversational
prompts with the PIL images in an ``images`` column (its processor comes from ``AutoProcessor``, which
needs torchvision). Both train the whole model, vision tower included. ``image_tokens`` in the JSON; TRL's
``tokens_per_s`` counts them in the prompt (not the chat template's turn markers); ``logged_tokens_per_s``
is from TRL's own ``num_tokens`` log (every prompt and completion token: the figure to hold against
tidal's ``tokens_per_s``, for text workloads too).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import itertools
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from family_shapes import FAMILY_SHAPES, family_config  # noqa: E402
from rollout import module_kernels  # noqa: E402
from train_step import CONFIGS, model_config, versions  # noqa: E402
from vlm_shapes import TINY_GRPO, VLM_SHAPES, build_vlm_checkpoint, image_tokens, vlm_prompt_rows  # noqa: E402

PHASES = ("generate", "wake", "make_experience", "advantages", "train", "sync_weights", "sleep")
ISSUE_FLAGS = (
    "--colocate_all_models", "--vllm_enable_sleep", "--deepspeed_enable_sleep", "--gradient_checkpointing",
    "--param_dtype", "bf16", "--micro_train_batch_size", "8", "--micro_rollout_batch_size", "256",
)  # fmt: skip
MODE_FLAGS = {"full": ("--master_dtype", "bf16"), "lora": ("--lora_rank", "64", "--lora_alpha", "128")}
BF16_MASTER = {
    "qwen2.5-7b",
    "qwen2.5-vl-7b",
    "qwen3-vl-8b",
}  # the configs whose full-parameter run needs --master_dtype bf16 on one H200 with a 128 GiB host
# The workload's shapes: train_step's Qwen2.5 ones, Qwen3.5-0.8B's, and a tiny Qwen3.5 for CPU smoke runs.
WORKLOADS = sorted([*CONFIGS, "qwen3.5-0.8b", "tiny-qwen3.5", *VLM_SHAPES, *TINY_GRPO])
VLM = {*VLM_SHAPES, *TINY_GRPO}  # vision-language workloads: one image a prompt
VLM_FLAGS = ("--apply_chat_template", "--max_images_per_prompt", "1", "--image_key", "images")
HYBRID = {"qwen3.5-0.8b", "tiny-qwen3.5"}  # Gated DeltaNet models: each side runs without and with fla
BASE_VOCAB = 512  # the trained part of the tokenizer; the rest of the model's vocab are added tokens
REWARD = '''def reward_func(queries, prompts, labels, **kwargs):
    """A rule with spread: how many of the response's characters are digits, of every 10."""
    import torch

    responses = [q[len(p):] for q, p in zip(queries, prompts)]
    return {"rewards": torch.tensor([sum(c.isdigit() for c in r) % 10 / 10 for r in responses])}
'''


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen2.5-7b", choices=WORKLOADS)
    p.add_argument("--device", default="cpu", help="cuda or cpu (where the run trains)")
    p.add_argument("--modes", nargs="+", default=["full", "lora"], choices=sorted(MODE_FLAGS))
    p.add_argument("--steps", type=int, default=2, help="timed RL steps after the warm-up one")
    p.add_argument("--prompts", type=int, default=32, help="prompts per rollout")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--workdir", help="checkpoint, data and outputs (default: /tmp/tidal_grpo_<config>)")
    p.add_argument("--no_trl", action="store_true", help="skip TRL's GRPOTrainer")
    p.add_argument(
        "--fla", nargs="+", default=["off", "on"], choices=["off", "on"],
        help="hybrid models: run each side with flash-linear-attention blocked (off) and/or importable (on)",
    )  # fmt: skip
    p.add_argument("--child", choices=[*MODE_FLAGS, "trl"], help=argparse.SUPPRESS)
    p.add_argument("--child_fla", choices=["off", "on"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.workdir = args.workdir or f"/tmp/tidal_grpo_{args.config}"  # a checkpoint per shape, reused
    if args.config in VLM_SHAPES and "--prompts" not in (argv or sys.argv):
        args.prompts = 8  # 8 x 8 = 64 samples a rollout, bench/vlm_rollout.py's batch
    if args.config.startswith("tiny"):  # a CPU smoke run: few short samples
        args.prompts, args.n, args.prompt_len, args.new_tokens = 4, 2, 8, 8
    return args


# ---- the workload -------------------------------------------------------------------------------
def build_checkpoint(folder: Path, config_name: str, device: str) -> Path:
    """A random-init bf16 checkpoint of ``CONFIGS[config_name]`` with a tokenizer covering its whole
    vocabulary (a tiny trained BPE plus added tokens), written once and reused."""
    import torch
    from transformers import AutoModelForCausalLM

    from tidal.testing.tiny import build_tiny_tokenizer

    if config_name in VLM:
        return build_vlm_checkpoint(folder, config_name, device)
    if (folder / "config.json").exists():
        return folder
    tokenizer = build_tiny_tokenizer(folder, vocab_size=BASE_VOCAB, seed=0)
    config = workload_config(config_name)
    tokenizer.add_tokens([f"<x{i}>" for i in range(config.vocab_size - len(tokenizer))])
    tokenizer.save_pretrained(folder)
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(0)
    with torch.device(device):  # initialised on the GPU: seconds instead of minutes for 7.6B parameters
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="5GB")
    return folder


def workload_config(name: str):
    """The HF config of a ``WORKLOADS`` shape."""
    if name in FAMILY_SHAPES:
        return family_config(name)
    if name == "tiny-qwen3.5":
        from tidal.testing.tiny import tiny_config

        return tiny_config("qwen3_5_text", vocab_size=1024)
    return model_config(name)


def block_fla() -> None:
    """Make flash-linear-attention (and causal-conv1d) unimportable in this process, before transformers'
    Qwen3.5 modeling resolves its kernels at import: its torch fallback, what a user without them gets."""
    for name in ("fla", "causal_conv1d"):
        sys.modules[name] = None  # ``import fla`` now raises ImportError; ``find_spec`` returns None


def kernel_paths(config_name: str) -> dict | None:
    """Hybrid workloads: the implementation transformers' Qwen3.5 Gated DeltaNet functions resolved to."""
    if config_name not in HYBRID:
        return None
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return module_kernels(modeling_qwen3_5)


def write_data(folder: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """(prompts.jsonl: one rollout's prompts per RL step, warm-up included; the reward function file)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    rng = random.Random(0)
    texts = [
        tokenizer.decode([rng.randrange(3, BASE_VOCAB) for _ in range(args.prompt_len)])
        for _ in range(args.prompts * (args.steps + 1))
    ]
    rows = vlm_prompt_rows(folder, texts) if is_vlm(args) else [{"prompt": t, "label": ""} for t in texts]
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = folder / "reward.py"
    reward.write_text(REWARD)
    return prompts, reward


def tidal_flags(args, folder: Path, mode: str) -> list[str]:
    prompts, reward = folder / "prompts.jsonl", folder / "reward.py"
    samples = args.prompts * args.n
    return [
        "--pretrain", str(folder / "model"), "--prompt_data", str(prompts), "--input_key", "prompt",
        "--label_key", "label", "--remote_rm_url", str(reward), "--advantage_estimator", "group_norm",
        "--init_kl_coef", "0", "--rollout_batch_size", str(args.prompts), "--n_samples_per_prompt", str(args.n),
        "--train_batch_size", str(samples), "--prompt_max_len", str(2 * args.prompt_len + vlm_prompt_extra(args)),
        "--generate_max_len", str(args.new_tokens), "--num_episodes", "1", "--actor_learning_rate", "1e-6",
        "--save_path", str(folder / f"out_{mode}"), "--save_steps", "-1", *ISSUE_FLAGS, *mode_flags(args, mode),
        *(VLM_FLAGS if is_vlm(args) else ()),
    ]  # fmt: skip


def is_vlm(args) -> bool:
    """Whether the workload is a vision-language one (a namespace without ``config`` is the 7B text one)."""
    return getattr(args, "config", "qwen2.5-7b") in VLM


def vlm_prompt_extra(args) -> int:
    """Room a VLM prompt needs beyond its text: the image's tokens and the chat template's turn markers."""
    return vlm_image_tokens(args) + 32 if is_vlm(args) else 0


def vlm_image_tokens(args) -> int:
    """Tokens of each prompt's image in the language model (0: a text workload; tiny VLMs: at most 4)."""
    name = getattr(args, "config", "qwen2.5-7b")
    if name in TINY_GRPO:
        return 4
    return image_tokens(name, 448) if name in VLM_SHAPES else 0


def mode_flags(args, mode: str) -> tuple[str, ...]:
    """The mode's flags; full parameters store bf16 master weights only where the memory plan needs it (a
    namespace without ``config``, as tests/bench/test_grpo_7b.py passes, is the 7B workload)."""
    if mode == "full" and getattr(args, "config", "qwen2.5-7b") not in BF16_MASTER:
        return ()
    return MODE_FLAGS[mode]


# ---- one mode, in its own process ---------------------------------------------------------------------
def run_tidal(args, folder: Path, mode: str) -> dict:
    """``tidal ppo`` on the workload: the warm-up step apart, then the median of the timed steps."""
    import torch

    from tidal.cli.train_ppo import parse_run
    from tidal.trainers.ppo import run_ppo

    start = time.perf_counter()
    history = run_ppo(parse_run(tidal_flags(args, folder, mode)))
    total = time.perf_counter() - start
    steps = [h for h in history if "time/step" in h]
    warm, timed = steps[0], steps[1:] or steps[:1]
    samples = args.prompts * args.n
    step_s = statistics.median(h["time/step"] for h in timed)
    generated = statistics.median(h["response_length"] for h in timed) * samples
    trained = statistics.median(h["total_length"] for h in timed) * samples
    result = {
        "step_s": round(step_s, 3),
        "phases_s": {p: round(statistics.median(h.get(f"time/{p}", 0.0) for h in timed), 3) for p in PHASES},
        "warmup_step_s": round(warm["time/step"], 3),
        "startup_s": round(total - sum(h["time/step"] for h in steps), 1),
        "generated_tokens_per_step": round(generated),
        "trained_tokens_per_step": round(trained),
        "generated_tokens_per_s": round(generated / step_s),
        "trained_tokens_per_s": round(trained / step_s),
        "tokens_per_s": round(trained / step_s),  # docs/architecture.md section 6: prompt + response
        "generated_plus_trained_tokens_per_s": round((generated + trained) / step_s),
        "decode_tokens_per_s": round(
            generated / max(statistics.median(h["time/generate"] for h in timed), 1e-9)
        ),
        "reward": round(statistics.mean(h["reward"] for h in timed), 4),
    }
    result["hf_kernels"] = kernel_paths(args.config)
    if args.config in HYBRID:
        from tidal.rollout.models.gated_delta import USE_FLA, fla_installed

        result["engine_fla"] = USE_FLA and torch.cuda.is_available() and fla_installed()
    peaks = [v for h in timed for k, v in h.items() if k.startswith("memory/peak_gb")]
    if peaks:
        result["peak_mem_gb"] = max(peaks)
    if torch.cuda.is_available():
        result["gpu"] = torch.cuda.get_device_name()
    return result


def run_trl(args, folder: Path) -> dict:
    """TRL's GRPOTrainer on the same workload; step times from a callback, the first step apart."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in (folder / "prompts.jsonl").read_text().splitlines()]
    if args.config in VLM:  # conversational prompts with PIL images: TRL's vision-language input
        from PIL import Image

        rows = [dict(r, images=[Image.open(folder / p).convert("RGB") for p in r["images"]]) for r in rows]
    times: list[float] = []
    counted: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)

        def on_log(self, *a, logs=None, **k):
            if logs and "num_tokens" in logs:  # TRL's running count of prompt + completion tokens
                counted.append(float(logs["num_tokens"]))

    def reward(completions, **kwargs):
        texts = [
            c if isinstance(c, str) else c[-1]["content"] for c in completions
        ]  # conversational: messages
        return [sum(c.isdigit() for c in text) % 10 / 10 for text in texts]

    samples = args.prompts * args.n
    micro = 8
    config = GRPOConfig(
        output_dir=str(folder / "out_trl"), per_device_train_batch_size=micro,
        gradient_accumulation_steps=samples // micro, num_generations=args.n,
        max_completion_length=args.new_tokens, gradient_checkpointing=True, bf16=torch.cuda.is_available(),
        learning_rate=1e-6, beta=0.0, max_steps=args.steps + 1, logging_steps=1, save_strategy="no",
        report_to=[], model_init_kwargs={"dtype": torch.bfloat16 if torch.cuda.is_available() else torch.float32},
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=str(folder / "model"), reward_funcs=reward, args=config, train_dataset=Dataset.from_list(rows),
        callbacks=[StepTimes()],
    )  # fmt: skip
    trainer.train()
    step_s = statistics.median(times[1:] or times)
    tokens = samples * (
        args.prompt_len + vlm_image_tokens(args) + args.new_tokens
    )  # at most: TRL stops samples at EOS, which is rare
    return {
        "step_s": round(step_s, 3),
        "warmup_step_s": round(times[0], 3),
        "tokens_per_s": round(tokens / step_s),
        # from TRL's own count (image and chat-template tokens included): median tokens of a timed step
        "logged_tokens_per_s": logged_rate(counted, step_s),
        "hf_kernels": kernel_paths(args.config),
        "trl": importlib.metadata.version("trl"),
        "generation": "transformers.generate (use_vllm=False: no vLLM on the device)",
    }


def logged_rate(counted: list[float], step_s: float) -> int | None:
    """Tokens a step by TRL's cumulative ``num_tokens`` log (the warm-up step's left out) / step time."""
    steps = [b - a for a, b in itertools.pairwise(counted)]  # the first step's count is the warm-up's
    return round(statistics.median(steps) / step_s) if steps else None


def child(args) -> dict:
    if args.child_fla == "off":
        block_fla()
    folder = Path(args.workdir)
    if args.child == "trl":
        return run_trl(args, folder)
    return run_tidal(args, folder, args.child)


def in_process(args, what: str, fla: str | None = None) -> dict:
    """One mode (or TRL) in a fresh process; its last stdout line is its JSON, else the reason it failed."""
    cmd = [sys.executable, __file__, *sys.argv[1:], "--child", what]
    if fla is not None:
        cmd += ["--child_fla", fla]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        print(f"[bench/grpo_7b] {what} (fla {fla}): {lines[-1]}", file=sys.stderr, flush=True)
        return json.loads(lines[-1])
    errors = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    # from the last exception line on (an ImportError's message comes on the lines after it)
    named = [i for i, line in enumerate(errors) if "Error" in line.split(":")[0]]
    reason = " ".join(errors[named[-1] if named else -1 :]) if errors else f"exit status {proc.returncode}"
    result = {"skipped": reason[:500]}
    print(f"[bench/grpo_7b] {what} (fla {fla}): {json.dumps(result)}", file=sys.stderr, flush=True)
    return result


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    folder = Path(args.workdir)
    folder.mkdir(parents=True, exist_ok=True)
    build_checkpoint(folder / "model", args.config, args.device)
    write_data(folder, args)
    out = {"bench": "grpo_7b", **versions(), "config": args.config, "device": args.device,
           "prompts": args.prompts, "n": args.n, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
           "steps": args.steps, "flags": " ".join(ISSUE_FLAGS)}  # fmt: skip
    if args.config in VLM:
        out.update(image_side=448, image_tokens=vlm_image_tokens(args), vlm_flags=" ".join(VLM_FLAGS))
    for mode in args.modes:
        out[mode] = {"extra_flags": " ".join(mode_flags(args, mode)), **variants(args, mode)}
    if args.no_trl:
        out["trl"] = {"skipped": "--no_trl"}
    else:
        found = importlib.util.find_spec("trl") is not None
        out["trl"] = variants(args, "trl") if found else {"skipped": "trl is not installed"}
    print(json.dumps(out))


def variants(args, what: str) -> dict:
    """``what`` in its own process; for hybrid models once per ``--fla`` setting (keys fla_off, fla_on)."""
    if args.config not in HYBRID:
        return in_process(args, what)
    fla_found = importlib.util.find_spec("fla") is not None
    return {
        f"fla_{fla}": in_process(args, what, fla)
        if fla == "off" or fla_found
        else {"skipped": "fla (flash-linear-attention) is not installed"}
        for fla in args.fla
    }


if __name__ == "__main__":
    main()
