"""``tidal demo``: tidal end to end on a laptop CPU in a few minutes, with nothing downloaded.

1. builds a tiny random-init model and tokenizer offline (``tidal.testing``);
2. makes a synthetic task with exact answers (multi-digit addition);
3. measures task accuracy by greedy generation on held-out prompts with tidal's rollout engine;
4. fine-tunes with SFT and measures again;
5. writes the loss curve as a PNG and a summary JSON into the run folder.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tidal.cli.common import make_parser, run_command
from tidal.config.args import arg, config_from_args
from tidal.logging import get_logger, plot_metrics
from tidal.testing import AdditionTask, build_tiny_model

log = get_logger(__name__)


@dataclass
class DemoConfig:
    """Demo: the tiny model, the task and the training budget."""

    output_dir: str = arg("./runs/demo", help="run folder (model, data, checkpoints, plots)")
    family: str = arg("qwen2", help="tiny model family", choices=("llama", "qwen2", "qwen3", "mistral"))
    digits: int = arg(2, help="digits per addend")
    train_samples: int = arg(8192, help="synthetic SFT samples")
    eval_samples: int = arg(256, help="held-out prompts for accuracy")
    sft_epochs: int = arg(2, help="SFT epochs")
    sft_learning_rate: float = arg(2e-3, help="SFT peak learning rate")
    seed: int = arg(0, help="seed for the model, data and training")


def accuracy(model_path: Path, task: AdditionTask, samples: list[dict]) -> float:
    """Fraction of held-out prompts answered exactly, by greedy generation with tidal's engine."""
    from tidal.rollout import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(str(model_path), EngineConfig(max_num_seqs=len(samples), device="cpu"))
    params = SamplingParams(temperature=0.0, max_new_tokens=task.digits + 3)
    outputs = engine.generate([s["prompt"] for s in samples], params)
    correct = [task.is_correct(o.outputs[0].text, s["answer"]) for o, s in zip(outputs, samples, strict=True)]
    return sum(correct) / len(correct)


def sft_stage(cfg: DemoConfig, base: Path, train_file: Path, out: Path) -> Path:
    from tidal.cli.train_sft import parse_run
    from tidal.trainers.sft import run_sft

    run_sft(
        parse_run([
            "--pretrain", str(base), "--dataset", str(train_file), "--input_key", "prompt", "--output_key", "answer",
            "--max_len", "32", "--train_batch_size", "32", "--micro_train_batch_size", "32", "--packing_samples",
            "--max_epochs", str(cfg.sft_epochs), "--learning_rate", str(cfg.sft_learning_rate),
            "--lr_warmup_ratio", "0.05", "--seed", str(cfg.seed), "--logging_steps", "10",
            "--save_path", str(out), "--ckpt_path", str(out.parent / "sft_ckpt"),
        ])
    )  # fmt: skip
    return out


def run_demo(cfg: DemoConfig) -> dict:
    """Run every stage; returns (and writes) the summary."""
    root = Path(cfg.output_dir)
    start = time.perf_counter()
    task = AdditionTask(digits=cfg.digits, seed=cfg.seed)
    base = build_tiny_model(root / "base_model", cfg.family, seed=cfg.seed)
    train_file = task.write_jsonl(root / "data" / "sft.jsonl", cfg.train_samples, split="train")
    held_out = task.samples(cfg.eval_samples, split="test")
    summary = {"config": asdict(cfg), "accuracy": {"base": accuracy(base, task, held_out)}}
    log.info("accuracy before training: %.1f%%", 100 * summary["accuracy"]["base"])

    sft_model = sft_stage(cfg, base, train_file, root / "sft_model")
    summary["accuracy"]["sft"] = accuracy(sft_model, task, held_out)
    log.info("accuracy after SFT: %.1f%%", 100 * summary["accuracy"]["sft"])

    plot = plot_metrics(
        sft_model / "run" / "metrics.jsonl", root / "curves.png", ["train/loss"], title="SFT loss"
    )
    summary["plot"] = str(plot)
    summary["seconds"] = round(time.perf_counter() - start, 1)
    (root / "summary.json").write_text(json.dumps(summary, indent=2))
    print_summary(summary)
    return summary


def print_summary(summary: dict) -> None:
    acc = summary["accuracy"]
    print("\n=== tidal demo: addition accuracy on held-out prompts (greedy) ===")
    for stage, value in acc.items():
        print(f"  {stage:<6} {100 * value:5.1f}%")
    print(f"loss curve: {summary['plot']}   ({summary['seconds']} s)")


def build_parser(prog: str = "tidal demo") -> argparse.ArgumentParser:
    return make_parser(
        prog, "End-to-end demo on CPU with a tiny model (nothing is downloaded).", [(DemoConfig, "demo")]
    )


def main(argv: list[str] | None = None, prog: str = "tidal demo"):
    return run_command(build_parser(prog), argv, lambda ns: run_demo(config_from_args(DemoConfig, ns)))


if __name__ == "__main__":
    main()
