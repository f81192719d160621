"""Dataset-source configuration: which files to read, how to blend them, and the eval set."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config.args import Range, arg

# OpenRLHF v0.9.2's --input_template default for train_sft, train_kto and train_kd (its other trainers
# default to none); those runs set it as their data config's default (docs/openrlhf.md, "Defaults").
OPENRLHF_INPUT_TEMPLATE = "User: {}\nAssistant: "


@dataclass
class DatasetConfig:
    """Datasets: local files or folders (comma-separated to blend), and the eval set."""

    dataset: str = arg(
        help="comma-separated .json/.jsonl/.csv/.parquet/.arrow files, save_to_disk folders or hub names"
    )
    dataset_probs: str | None = arg(
        None, help="blend weights for the datasets, e.g. 0.3,0.7", aliases=["--prompt_data_probs"]
    )
    dataset_split: str = arg("train", help="split to read from folders and hub datasets")
    eval_dataset: str | None = arg(None, help="evaluation dataset (same formats)")
    eval_split: str = arg("train", help="split of the evaluation dataset")
    max_samples: int | None = arg(
        None, help="use at most this many training samples", check=Range(1, also=(-1,))
    )


@dataclass
class PromptDataConfig:
    """Prompts for RL: datasets, keys and templates."""

    prompt_data: str = arg(
        help="prompt datasets (same formats as --dataset), comma-separated", aliases=["--dataset"]
    )
    prompt_data_probs: str | None = arg(
        None, help="blend weights for the prompt datasets", aliases=["--dataset_probs"]
    )
    prompt_split: str = arg("train", help="split to read from folders and hub datasets")
    eval_dataset: str | None = arg(None, help="evaluation prompts (same formats)")
    eval_split: str = arg("train", help="split of the evaluation dataset")
    max_samples: int | None = arg(None, help="use at most this many prompts", check=Range(1, also=(-1,)))
    input_key: str = arg("input", help="dataset key of the prompt (text or chat messages)")
    label_key: str | None = arg(None, help="dataset key passed to reward functions and agents as labels")
    input_template: str | None = arg(
        None, help="template with {} for the prompt text, e.g. 'User: {}\\nAssistant: '"
    )
    apply_chat_template: bool = arg(False, help="render prompts with the tokenizer's chat template")


@dataclass
class HeldOutDatasetConfig(DatasetConfig):
    """Datasets whose evaluation split defaults to ``test`` (OpenRLHF v0.9.2's train_prm, train_dpo,
    train_kto and train_kd; train_sft and train_rm read ``train``). A single file has one split, so this
    matters only for folders and hub datasets."""

    eval_split: str = arg("test", help="split of the evaluation dataset")


@dataclass
class VisionConfig:
    """Images in prompts, for vision-language models (tidal sft, dpo, rm, ppo; generate: the first two)."""

    # OpenRLHF's spellings --data.image_key, --data.max_images_per_prompt and --actor.freeze_visual_encoder
    # are rewritten to these (tidal.cli.openrlhf).

    image_key: str = arg(
        "images",
        help="dataset key of each row's images: a list of file paths (relative ones are read beside the "
        "data file), base64 strings or data URIs, or raw bytes",
    )
    max_images_per_prompt: int = arg(
        0,
        help="most images a row may have (a row with more is an error); 0: text only, rows with images "
        "are refused",
        check=Range(0),
    )
    freeze_visual_encoder: bool = arg(
        False, help="train the language model only: the vision tower's weights stay as loaded"
    )
