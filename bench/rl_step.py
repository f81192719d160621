"""Benchmark: one GRPO step end to end on one device, timed by phase.

The step is the RL loop of ``tidal.trainers.ppo`` built from its own parts, in local mode (one process,
policy and rollout engine on the same device):

1. ``generate``: ``LLMEngine.generate`` (tidal's rollout engine, weights copied from the policy) for
   ``--prompts`` random prompts of ``--prompt_len`` tokens × ``--n`` samples, ``--new_tokens`` new tokens
   each with ``ignore_eos`` (every sample has the same length; set only here, not a user flag), turned
   into an ``Experience`` by ``tidal.agents.Trajectory`` and ``tidal.experience.maker.from_trajectories``;
2. ``reward``: a trivial rule (the fraction of even token ids in the response), then ``shape_rewards``;
3. ``old_logprobs``: ``forward_logprobs`` (no grad, packed micro-batches) — skipped, as the trainer
   skips it, when the update is one on-policy optimizer step (``old_logprobs_from_update``; always the
   case here) unless ``--scoring_pass``;
4. ``advantages``: ``add_advantages`` with ``group_norm`` (GRPO), no KL (``--init_kl_coef 0``);
5. ``update``: ``train_on_experience`` with ``PolicyLoss`` (one optimizer step over the whole rollout,
   packed micro-batches, gradient checkpointing, bf16 autocast over float32 master weights);
6. ``sync_weights``: ``engine.update_weights(engine_weights(policy))``.

Prints one JSON line: the median over ``--steps`` timed steps (after ``--warmup``, which also captures
the engine's CUDA graphs) of each phase and the whole step, and tokens/s as docs/architecture.md §6 defines it:
(prompt + response tokens) / step time / GPUs. ``logprob_mismatch`` (mean |old − rollout| log-prob
over response tokens) checks that engine and trainer agree. The reference is the same step's
generation share: at 256 new tokens the step is bounded below by the engine's decode time.

The policy is a random-init model of ``--config``: a dense Qwen2.5 shape of bench/train_step.py or a
Qwen3-MoE shape of bench/moe.py (``qwen3-moe-2b``: 16 experts, top-2, ~2.2B parameters; ``tiny-moe``).
For MoE policies the JSON also names the trainer's experts kernel (transformers' ``experts_implementation``)
and whether the engine ran the fused Triton experts.

    python bench/rl_step.py                                # tiny model on CPU, < 1 minute
    python bench/rl_step.py --config tiny-moe              # tiny MoE on CPU
    python bench/rl_step.py --device cuda --config qwen2.5-0.5b
    python bench/rl_step.py --device cuda --config qwen3-moe-2b
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe import moe_config  # noqa: E402
from train_step import (  # noqa: E402
    CONFIGS,
    make_model,
    optimization,
    reset_memory,
    stub_missing_datasets,
    sync,
    versions,
)

from tidal.trainers.ppo.update import MISMATCH  # noqa: E402

# bench/moe.py shapes small enough to train (fp32 master weights + Adam) on one GPU.
MOE_POLICIES = ("qwen3-moe-2b", "tiny-moe")
PHASES = ("generate", "reward", "old_logprobs", "advantages", "update", "sync_weights")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny", choices=[*sorted(CONFIGS), *MOE_POLICIES])
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument(
        "--micro", type=int, default=64, help="samples per packed micro-batch (scoring and update)"
    )
    p.add_argument("--no_gradient_checkpointing", action="store_true")
    p.add_argument("--compile", action="store_true", help="--torch_compile: compile the policy's blocks")
    p.add_argument(
        "--scoring_pass",
        action="store_true",
        help="compute the old log-probs in their own forward even when the update could (as before)",
    )
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--profile",
        action="store_true",
        help="one more step under torch.profiler: GPU kernel time per phase by kind (JSON) and top kernels (stderr)",
    )
    p.add_argument("--top", type=int, default=12, help="with --profile: kernels listed per phase")
    args = p.parse_args(argv)
    if args.device == "cpu" and args.config in ("tiny", "tiny-moe") and args.new_tokens == 256:
        args.prompts, args.n, args.prompt_len, args.new_tokens, args.micro = 4, 4, 16, 16, 8
    return args


def make_policy(name: str, device: torch.device, gradient_checkpointing: bool, seed: int):
    """``train_step.make_model`` for a dense shape; for a MoE shape the same steps on its config."""
    if name not in MOE_POLICIES:
        return make_model(name, device, gradient_checkpointing, seed)
    from transformers import AutoModelForCausalLM

    from tidal.models.moe_experts import use_trainer_experts

    torch.manual_seed(seed)
    with device:
        model = AutoModelForCausalLM.from_config(
            moe_config(name), dtype=torch.float32, attn_implementation="sdpa"
        )
    model.config.use_cache = False
    use_trainer_experts(model)  # as tidal.models.load_causal_lm does for a MoE model
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def moe_report(policy, device: torch.device, precision) -> dict:
    """For a MoE policy: the trainer's experts kernel, the dtype its grouped GEMMs run in under the
    update's autocast, and whether the engine's fused experts ran."""
    if getattr(policy.config, "num_experts", None) is None:
        return {}
    from tidal.accel import triton_available
    from tidal.models.moe_experts import TRAINER_EXPERTS, experts_compute_dtype
    from tidal.rollout.models import moe

    implementation = policy.config._experts_implementation
    weight = next(p for n, p in policy.named_parameters() if n.endswith("experts.gate_up_proj"))
    gemm_dtype = weight.dtype if implementation == "grouped_mm" else None  # transformers: the weights'
    if implementation == TRAINER_EXPERTS:
        with precision.autocast():
            gemm_dtype = experts_compute_dtype(weight, device.type)
    return {
        "experts_implementation": implementation,
        "experts_gemm_dtype": None if gemm_dtype is None else str(gemm_dtype).removeprefix("torch."),
        "engine_fused_moe": moe.FUSED_MOE and device.type == "cuda" and triton_available(),
    }


class GRPOStep:
    """The parts of a local-mode RL run and one step over them (see the module docstring)."""

    def __init__(self, args, device: torch.device):
        from tidal.config.rl import AlgorithmConfig
        from tidal.distributed.world import World
        from tidal.rollout import EngineConfig, LLMEngine

        self.args, self.device = args, device
        self.policy = make_policy(args.config, device, not args.no_gradient_checkpointing, args.seed)
        if args.compile:
            from tidal.models.compile import compile_blocks

            compile_blocks(self.policy)
        self.opt = optimization(self.policy, device)
        self.world = World(device=device)
        self.rl = AlgorithmConfig(advantage_estimator="group_norm", init_kl_coef=0.0)
        engine_cfg = EngineConfig(
            max_num_seqs=args.prompts * args.n, max_model_len=args.prompt_len + args.new_tokens,
            gpu_memory_utilization=0.3, device=str(device), seed=args.seed,
        )  # fmt: skip
        self.engine = LLMEngine(config=engine_cfg, model=self.policy)
        vocab = self.policy.config.vocab_size
        g = torch.Generator().manual_seed(args.seed)
        self.prompt_ids = torch.randint(0, vocab, (args.prompts, args.prompt_len), generator=g).tolist()

    def generate(self, step: int):
        from tidal.agents import Trajectory
        from tidal.experience.maker import from_trajectories
        from tidal.rollout import SamplingParams

        a = self.args
        params = SamplingParams(
            n=a.n, temperature=1.0, max_new_tokens=a.new_tokens, ignore_eos=True, seed=step
        )
        outputs = self.engine.generate(self.prompt_ids, params)
        trajectories = []
        for ids, out in zip(self.prompt_ids, outputs, strict=True):
            for completion in out.outputs:
                t = Trajectory.start("", None, ids)
                t.add_action(completion.token_ids, completion.logprobs)
                trajectories.append(t)
        return from_trajectories(trajectories, pad_id=0)

    def reward(self, exp):
        from tidal.experience.maker import shape_rewards

        # Trivial rule: the fraction of even token ids among the response tokens.
        even = ((exp.sequences % 2 == 0) & exp.action_mask.bool()).sum(-1)
        exp.rewards = exp.scores = even.float() / exp.action_mask.sum(-1).clamp(min=1)
        exp = exp.to(self.device)
        exp.rewards = shape_rewards(exp, self.rl, self.args.new_tokens, None)
        return exp

    def old_logprobs(self, exp):
        """The trainer's rule: one on-policy optimizer step takes them from its own forward (skipped
        here, ``old_logprobs_from_update``) unless ``--scoring_pass``."""
        from tidal.experience.maker import forward_logprobs
        from tidal.trainers.ppo.update import old_logprobs_from_update

        if not self.args.scoring_pass and old_logprobs_from_update(1, len(exp), len(exp), False):
            exp.old_logprobs = None
            return exp
        p = self.opt.precision
        exp.old_logprobs = forward_logprobs(self.policy, exp, self.args.micro, True, 1.0, p)
        return exp

    def advantages(self, exp):
        from tidal.experience.maker import add_advantages

        return add_advantages(exp, self.rl, self.args.n, kl_coef=0.0)

    def update(self, exp, step: int) -> dict:
        from tidal.trainers.ppo.update import PolicyLoss, StepShape, train_on_experience

        shape = StepShape(step_size=len(exp), micro_size=self.args.micro, packing=True)
        loss = PolicyLoss(self.rl, self.opt.precision, 1.0, packing=True)
        generator = torch.Generator().manual_seed(step)
        return train_on_experience(self.opt, exp, loss, shape, self.world, generator)

    def sync_weights(self) -> int:
        from tidal.distributed.weight_sync import engine_weights

        with engine_weights(self.policy) as named:
            return self.engine.update_weights(named)

    def run(self, step: int, around=None) -> tuple[dict[str, float], dict]:
        """One step; returns (seconds per phase, stats). ``around(phase)``, if given, is a context
        manager entered around each phase (``--profile``)."""
        seconds: dict[str, float] = {}

        def timed(phase, fn, *a):
            sync(self.device)
            with around(phase) if around else contextlib.nullcontext():
                start = time.perf_counter()
                out = fn(*a)
                sync(self.device)
                seconds[phase] = time.perf_counter() - start
            return out

        exp = timed("generate", self.generate, step)
        exp = timed("reward", self.reward, exp)
        exp = timed("old_logprobs", self.old_logprobs, exp)
        exp = timed("advantages", self.advantages, exp)
        stats = timed("update", self.update, exp, step)
        timed("sync_weights", self.sync_weights)
        mask = exp.action_mask.bool()
        if exp.old_logprobs is None:  # the update measured it
            stats["logprob_mismatch"] = stats[MISMATCH]
        else:
            stats["logprob_mismatch"] = float((exp.old_logprobs - exp.rollout_logprobs).abs()[mask].mean())
        stats["scored"] = exp.old_logprobs is not None
        stats["tokens"] = int(exp.attention_mask.sum())
        stats["response_tokens"] = int(mask.sum())
        return seconds, stats


def kernel_profile(bench: GRPOStep, step: int, top: int) -> dict:
    """One step with ``torch.profiler`` around each phase: per phase, GPU kernel milliseconds by kind
    (bench/profile_decode.py's categories) and the sum (``busy``); the top kernels go to stderr."""
    from profile_decode import category
    from torch.profiler import ProfilerActivity, profile

    report: dict[str, dict] = {}

    @contextlib.contextmanager
    def around(phase):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            yield
        per_kernel: dict[str, float] = {}
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                per_kernel[event.name] = per_kernel.get(event.name, 0.0) + event.device_time / 1e3
        by_kind: dict[str, float] = {}
        for name, ms in per_kernel.items():
            by_kind[category(name)] = by_kind.get(category(name), 0.0) + ms
        report[phase] = {k: round(v, 2) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}
        report[phase]["busy"] = round(sum(per_kernel.values()), 2)
        print(f"[{phase}] GPU busy {report[phase]['busy']:.1f} ms", file=sys.stderr)
        for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]:
            print(f"  {ms:9.2f} ms  {name[:100]}", file=sys.stderr)

    seconds, _ = bench.run(step, around)
    return {"kernel_ms": report, "profiled_phases_s": {p: round(s, 4) for p, s in seconds.items()}}


def main(argv=None) -> dict:
    args = parse_args(argv)
    stub_missing_datasets()
    device = torch.device(args.device)
    reset_memory(device)
    bench = GRPOStep(args, device)
    runs = [bench.run(step) for step in range(args.warmup + args.steps)]
    timed = runs[args.warmup :]
    phases = {p: round(statistics.median(r[0][p] for r in timed), 4) for p in PHASES}
    step_s = statistics.median(sum(r[0].values()) for r in timed)
    stats = timed[-1][1]
    report = {
        "bench": "rl_step", **versions(), "device": args.device, "config": args.config,
        "prompts": args.prompts, "n": args.n, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "gradient_checkpointing": not args.no_gradient_checkpointing, "compile": args.compile, "micro": args.micro,
        "scoring_pass": stats["scored"],  # the timed steps ran the old-log-prob forward
        "step_s": round(step_s, 4), "phases_s": phases,
        "first_step_s": round(sum(runs[0][0].values()), 3),
        "tokens_per_step": stats["tokens"], "tokens_per_s_per_gpu": round(stats["tokens"] / step_s),
        "logprob_mismatch": round(stats["logprob_mismatch"], 5),
        "policy_loss": round(float(stats.get("policy/loss", float("nan"))), 5),
        "grad_norm": round(float(stats.get("grad_norm", float("nan"))), 4),
        "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
        "attn_impl": bench.policy.config._attn_implementation,
        **moe_report(bench.policy, device, bench.opt.precision),
    }  # fmt: skip
    if args.profile and device.type == "cuda":
        report |= kernel_profile(bench, args.warmup + args.steps, args.top)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
