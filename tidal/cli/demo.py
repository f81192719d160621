"""``tidal demo``: tidal end to end on a laptop CPU in a few minutes, with nothing downloaded.

1. builds a tiny random-init model and tokenizer offline (``tidal.testing``);
2. makes a synthetic task with exact answers: addition (one-digit addends by default, ``--digits``);
3. SFT on *noisy* supervision: ``--sft_wrong_fraction`` of the answers are wrong sums, so the
   fine-tuned model usually knows the answer (greedy) but often samples a wrong one;
4. RL: GRPO with a rule reward (exact answer, partial credit per digit) from the SFT model;
5. preferences: samples the SFT model, pairs right against wrong answers, trains a reward model
   (accuracy on held-out pairs) and DPO from the SFT model;
6. measures accuracy after every stage, greedy and sampled (temperature 1), with tidal's rollout
   engine on test prompts (with one-digit addends all 100 problems also occur in training: the
   stages differ in how reliably the model answers, not in what it has seen), and writes a summary
   JSON and ``curves.png`` (one panel per stage, its training curve with the held-out results marked)
   into the run folder.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tidal.cli.common import make_parser, run_command
from tidal.config.args import arg, config_from_args
from tidal.logging import get_logger
from tidal.rollout.models.registry import FAMILIES  # plain data: --help stays torch-free

log = get_logger(__name__)


@dataclass
class DemoConfig:
    """Demo: the tiny model, the task and each stage's budget."""

    output_dir: str = arg("./runs/demo", help="run folder (models, data, plots, summary)")
    family: str = arg("qwen2", help="tiny model family", choices=tuple(FAMILIES))
    digits: int = arg(1, help="digits per addend")
    train_samples: int = arg(4096, help="synthetic SFT samples")
    eval_samples: int = arg(200, help="test prompts for accuracy")
    sft_epochs: int = arg(4, help="SFT epochs")
    sft_learning_rate: float = arg(2e-3, help="SFT peak learning rate")
    sft_wrong_fraction: float = arg(0.4, help="share of SFT answers replaced by wrong sums (noisy labels)")
    rl_rollouts: int = arg(40, help="GRPO rollouts (32 prompts x 8 samples each)")
    rl_learning_rate: float = arg(5e-4, help="GRPO learning rate")
    preference_prompts: int = arg(512, help="prompts sampled to build preference pairs")
    dpo_learning_rate: float = arg(5e-5, help="DPO learning rate")
    skip_preference: bool = arg(False, help="stop after the RL stage")
    seed: int = arg(0, help="seed for the model, data and training")


class Demo:
    """The stages, sharing the task, the held-out prompts and the run folder."""

    def __init__(self, cfg: DemoConfig):
        from tidal.testing import AdditionTask  # torch: when the demo runs, not for --help

        self.cfg, self.root = cfg, Path(cfg.output_dir)
        self.task = AdditionTask(digits=cfg.digits, seed=cfg.seed)
        self.held_out = self.task.samples(cfg.eval_samples, split="test")
        self.data = self.root / "data"

    def accuracy(self, model_path: Path) -> dict[str, float]:
        """Held-out exact-answer rate, greedy and sampled (temperature 1, 4 samples each), by tidal's engine."""
        from tidal.rollout import EngineConfig, LLMEngine, SamplingParams

        engine = LLMEngine(str(model_path), EngineConfig(device="cpu", seed=self.cfg.seed))
        prompts = [s["prompt"] for s in self.held_out]
        new = self.cfg.digits + 3
        result = {}
        for name, params in (
            ("greedy", SamplingParams(temperature=0.0, max_new_tokens=new)),
            ("sampled", SamplingParams(n=4, temperature=1.0, max_new_tokens=new, seed=self.cfg.seed)),
        ):
            outputs = engine.generate(prompts, params)
            right = [
                self.task.is_correct(c.text, s["label"])
                for o, s in zip(outputs, self.held_out, strict=True)
                for c in o.outputs
            ]
            result[name] = sum(right) / len(right)
        return result

    def sft(self, base: Path) -> Path:
        from tidal.cli.train_sft import parse_run
        from tidal.trainers.sft import run_sft

        c, out = self.cfg, self.root / "sft_model"
        train = self.task.write_jsonl(self.data / "sft.jsonl", c.train_samples, "train", c.sft_wrong_fraction)
        run_sft(parse_run([
            "--pretrain", str(base), "--dataset", str(train), "--input_key", "prompt", "--output_key", "answer",
            "--max_len", "32", "--train_batch_size", "32", "--micro_train_batch_size", "32", "--packing_samples",
            "--input_template", "{}", "--max_epochs", str(c.sft_epochs), "--learning_rate", str(c.sft_learning_rate),
            "--lr_warmup_ratio", "0.05", "--seed", str(c.seed), "--logging_steps", "10", "--save_path", str(out),
        ]))  # fmt: skip
        return out

    def rl(self, sft_model: Path, *extra: str) -> Path:
        """GRPO from ``sft_model``; ``extra``: more ``tidal ppo`` flags (benchmarks: e.g. FP8 rollouts)."""
        from tidal.cli.train_ppo import parse_run
        from tidal.trainers.ppo import run_ppo

        c, out = self.cfg, self.root / "rl_model"
        prompts = self.task.write_jsonl(self.data / "rl_prompts.jsonl", 32 * c.rl_rollouts, split="rl")
        reward_file = self.data / "reward_func.py"
        reward_file.write_text("from tidal.testing.tasks import addition_reward as reward_func\n")
        run_ppo(parse_run([
            "--pretrain", str(sft_model), "--prompt_data", str(prompts), "--input_key", "prompt",
            "--label_key", "label", "--remote_rm_url", str(reward_file), "--advantage_estimator", "group_norm",
            "--n_samples_per_prompt", "8", "--rollout_batch_size", "32", "--train_batch_size", "256",
            "--micro_train_batch_size", "128", "--micro_rollout_batch_size", "128", "--generate_max_len",
            str(c.digits + 3), "--prompt_max_len", "16", "--init_kl_coef", "0", "--actor_learning_rate",
            str(c.rl_learning_rate), "--lr_warmup_ratio", "0", "--seed", str(c.seed), "--save_path", str(out),
            *extra,
        ]))  # fmt: skip
        return out

    def preference_pairs(self, model: Path) -> tuple[Path, Path]:
        """Pairs from the model's own samples (a right answer chosen over a wrong one): train and held-out."""
        from tidal.rollout import EngineConfig, LLMEngine, SamplingParams

        prompts = self.task.samples(self.cfg.preference_prompts, split="pref")
        engine = LLMEngine(str(model), EngineConfig(device="cpu", seed=self.cfg.seed))
        params = SamplingParams(n=4, temperature=1.0, max_new_tokens=self.cfg.digits + 3, seed=self.cfg.seed)
        outputs = engine.generate([p["prompt"] for p in prompts], params)
        rng, rows = random.Random(self.cfg.seed), []
        for prompt, out in zip(prompts, outputs, strict=True):
            texts = [c.text.strip() for c in out.outputs]
            right = [t for t in texts if self.task.is_correct(t, prompt["label"])]
            wrong = [t for t in texts if not self.task.is_correct(t, prompt["label"])]
            chosen = right[0] if right else prompt["label"]  # fall back to the true answer
            if wrong:
                rows.append({"prompt": prompt["prompt"], "chosen": chosen, "rejected": rng.choice(wrong)})
        cut = len(rows) * 4 // 5
        train, held_out = self.data / "pairs_train.jsonl", self.data / "pairs_eval.jsonl"
        train.write_text("".join(json.dumps(r) + "\n" for r in rows[:cut]))
        held_out.write_text("".join(json.dumps(r) + "\n" for r in rows[cut:]))
        return train, held_out

    def reward_model(self, sft_model: Path, pairs: Path, held_out: Path) -> float:
        """Train a reward model from the SFT model; returns its accuracy on held-out pairs."""
        from tidal.cli.train_rm import parse_run
        from tidal.trainers.rm import run_rm

        out = self.root / "reward_model"
        run_rm(
            parse_run(self._pair_flags(sft_model, pairs, out, "1e-3", "3", "--eval_dataset", str(held_out)))
        )
        metrics = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
        return [m["eval/acc"] for m in metrics if "eval/acc" in m][-1]

    def dpo(self, sft_model: Path, pairs: Path) -> Path:
        from tidal.cli.train_dpo import parse_run
        from tidal.trainers.dpo import run_dpo

        out = self.root / "dpo_model"
        run_dpo(
            parse_run(
                self._pair_flags(sft_model, pairs, out, str(self.cfg.dpo_learning_rate), "1", "--beta", "0.1")
            )
        )
        return out

    def _pair_flags(
        self, model: Path, pairs: Path, out: Path, lr: str, epochs: str, *extra: str
    ) -> list[str]:
        return [
            "--pretrain", str(model), "--dataset", str(pairs), "--prompt_key", "prompt", "--chosen_key", "chosen",
            "--rejected_key", "rejected", "--max_len", "32", "--train_batch_size", "32",
            "--micro_train_batch_size", "32", "--max_epochs", epochs, "--learning_rate", lr, "--lr_warmup_ratio", "0.05",
            "--seed", str(self.cfg.seed), "--save_path", str(out), *extra,
        ]  # fmt: skip


def run_demo(cfg: DemoConfig) -> dict:
    """Run every stage on one CPU thread; returns (and writes) the summary."""
    import torch

    # The printed table is a figure the README quotes (and a test checks): with one thread the order of
    # every float sum, so every number, is the same on any core count. The tiny model gains little from more.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_stages(cfg)
    finally:
        torch.set_num_threads(threads)


def _run_stages(cfg: DemoConfig) -> dict:
    from tidal.testing import build_tiny_model

    start = time.perf_counter()
    demo = Demo(cfg)
    base = build_tiny_model(demo.root / "base_model", cfg.family, seed=cfg.seed)
    acc = {"base": demo.accuracy(base)}
    sft_model = demo.sft(base)
    acc["sft"] = demo.accuracy(sft_model)
    log.info(
        "greedy accuracy: base %.1f%% → SFT %.1f%%", 100 * acc["base"]["greedy"], 100 * acc["sft"]["greedy"]
    )
    acc["sft+grpo"] = demo.accuracy(demo.rl(sft_model))
    summary = {"config": asdict(cfg), "accuracy": acc}
    if not cfg.skip_preference:
        pairs, held_out = demo.preference_pairs(sft_model)
        summary["reward_model_pair_accuracy"] = demo.reward_model(sft_model, pairs, held_out)
        acc["sft+dpo"] = demo.accuracy(demo.dpo(sft_model, pairs))
    summary["plot"] = str(plot_curves(demo.root, summary))
    summary["seconds"] = round(time.perf_counter() - start, 1)
    (demo.root / "summary.json").write_text(json.dumps(summary, indent=2))
    print_summary(summary)
    return summary


def plot_curves(root: Path, summary: dict) -> Path:
    """One titled panel per stage (SFT, RM, GRPO, DPO: its training curve) with the held-out results
    measured after it marked, into ``curves.png``; a stage that did not run is left out."""
    from tidal.logging.plots import plot_panels

    return plot_panels(
        demo_panels(root, summary),
        root / "curves.png",
        title="tidal demo: training curves, held-out results dashed",
    )


def demo_panels(root: Path, summary: dict) -> list:
    """The ``tidal.logging.plots.Panel`` of each stage, its results taken from the demo's summary."""
    from tidal.logging.plots import Panel

    acc = summary["accuracy"]

    def after(stage: str) -> dict[str, float]:  # greedy and sampled accuracy, the SFT model's for comparison
        return {
            f"{kind} (SFT {100 * acc['sft'][kind]:.1f}%)": acc[stage][kind] for kind in ("greedy", "sampled")
        }

    metrics = {
        name: root / f"{name}_model" / "run" / "metrics.jsonl" for name in ("sft", "rl", "reward", "dpo")
    }
    panels = [
        Panel("SFT: loss on noisy answers", metrics["sft"], ["train/loss"],
              {f"greedy (base {100 * acc['base']['greedy']:.1f}%)": acc["sft"]["greedy"],
               "sampled": acc["sft"]["sampled"]}),
        Panel("RM: pairwise loss", metrics["reward"], ["train/loss"],
              {"held-out pair accuracy": summary.get("reward_model_pair_accuracy", 0.0)}),
        Panel("GRPO: rollout reward", metrics["rl"], ["train/reward"], after("sft+grpo")),
        Panel("DPO: preference loss", metrics["dpo"], ["train/loss"], after("sft+dpo") if "sft+dpo" in acc else {}),
    ]  # fmt: skip
    return panels


def print_summary(summary: dict) -> None:
    print("\n=== tidal demo: exact answers on addition test prompts ===")
    print(f"  {'stage':<9} {'greedy':>7} {'sampled (T=1)':>14}")
    for stage, value in summary["accuracy"].items():
        print(f"  {stage:<9} {100 * value['greedy']:6.1f}% {100 * value['sampled']:13.1f}%")
    if "reward_model_pair_accuracy" in summary:
        print(
            f"reward model: picks the right answer in {100 * summary['reward_model_pair_accuracy']:.1f}% of held-out pairs"
        )
    print(f"curves: {summary['plot']}   ({summary['seconds']} s)")


def build_parser(prog: str = "tidal demo") -> argparse.ArgumentParser:
    return make_parser(
        prog, "End-to-end demo on CPU with a tiny model (nothing is downloaded).", [(DemoConfig, "demo")]
    )


def main(argv: list[str] | None = None, prog: str = "tidal demo"):
    return run_command(build_parser(prog), argv, lambda ns: run_demo(config_from_args(DemoConfig, ns)))


if __name__ == "__main__":
    main()
