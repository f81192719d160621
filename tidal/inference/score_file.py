"""``python -m tidal.cli.batch_inference --eval_task rm``: score an existing file's responses with the
reward model at ``--pretrain`` (OpenRLHF's rm mode), then post-process and write JSONL.

Each row's ``--input_key`` (the prompt) and ``--output_key`` (its response) are rendered as for reward-model
training (``--input_template`` / ``--apply_chat_template``; a plain-text response ends with eos) and
scored (with ``--apply_chat_template`` and no ``--output_key`` column, as OpenRLHF, the conversation at
``--input_key`` is the prompt turns, then the response: its last turn, written as its text); a sequence longer than ``--max_len`` keeps its last tokens, as ``tidal serve_rm`` does, so the
scored final token stays. Rows are grouped by their prompt text (the samples ``tidal generate`` wrote
for one prompt, as OpenRLHF groups them) and go through ``--post_processor`` (rs, csft, iter_dpo) or
are all written with their ``reward``; the response is written under ``--output_key``.

This is the second step of OpenRLHF's rejection-sampling and iterative-DPO scripts: ``--eval_task
generate_vllm`` samples, ``--eval_task rm --post_processor rs`` keeps the best sample per prompt.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from tidal.config.args import ConfigError
from tidal.inference.generate import GenerateResult, GenerateRun
from tidal.inference.processors import PromptGroup, check_reward_template, make_post_processor
from tidal.logging import get_logger

log = get_logger(__name__)

DEFAULT_MICRO_BATCH = 16  # OpenRLHF's --micro_batch_size default

# Configs of GenerateRun whose flags only mean something when sampling (each: fields it may change).
_SAMPLING_ONLY = {
    "sampling": ("seed",),  # every sampling flag but --seed (which also orders blended datasets)
    "policy": (
        "pretrain",
        "param_dtype",
        "max_model_len",
        "tokenizer_chat_template",
        "disable_fast_tokenizer",
    ),
}
_PROMPTS_SAMPLING_ONLY = (
    "n_samples_per_prompt", "iter", "rollout_batch_size", "enable_csft", "label_key", "prompt_max_len"
)  # fmt: skip
_SCORING_SAMPLING_ONLY = ("reward_pretrain", "csft_reward", "eval_task", "eval_pass_threshold")


def _changed(cfg, names) -> list[str]:
    """The fields of ``cfg`` in ``names`` that differ from their defaults (as their flags)."""
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    return [f"--{name}" for name in names if getattr(cfg, name) != fields[name].default]


def rm_mode_problems(run: GenerateRun) -> list[str]:
    """Flags given with ``--eval_task rm`` that only mean something when sampling (never ignored)."""
    given = []
    for name, allowed in _SAMPLING_ONLY.items():
        cfg = getattr(run, name)
        given += _changed(cfg, [f.name for f in dataclasses.fields(cfg) if f.name not in allowed])
    given += _changed(run.prompts, _PROMPTS_SAMPLING_ONLY) + _changed(run.scoring, _SCORING_SAMPLING_ONLY)
    return [
        f"{flag} has no meaning with --eval_task rm, which scores the file's responses with the reward "
        "model at --pretrain (drop it)"
        for flag in given
    ]


def validate_rm_mode(run: GenerateRun) -> None:
    run.prompts.validate()
    problems = rm_mode_problems(run)
    if problems:
        raise ConfigError("\n".join(problems))
    if run.scoring.micro_batch_size is not None and run.scoring.micro_batch_size < 1:
        raise ConfigError(f"--micro_batch_size must be >= 1, got {run.scoring.micro_batch_size}")
    if run.scoring.reward_template is not None:
        if run.scoring.post_processor != "csft":
            raise ConfigError("--reward_template is only used by --post_processor csft")
        check_reward_template(run.scoring.reward_template)


def run_score_file(run: GenerateRun) -> GenerateResult:
    """Score, post-process and write; returns counts for the caller's summary."""
    from tidal.config.model import ModelConfig
    from tidal.data import DataError, load_dataset_spec
    from tidal.inference.scoring import SampleScorer
    from tidal.models import load_tokenizer

    validate_rm_mode(run)
    policy, ds_cfg, cfg = run.policy, run.datasets, run.prompts
    tokenizer = load_tokenizer(
        policy.pretrain,
        ModelConfig(pretrain=policy.pretrain, disable_fast_tokenizer=policy.disable_fast_tokenizer,
                    tokenizer_chat_template=policy.tokenizer_chat_template),
    )  # fmt: skip
    dataset = load_dataset_spec(
        ds_cfg.dataset, ds_cfg.dataset_probs, ds_cfg.dataset_split, ds_cfg.max_samples, run.sampling.seed
    )
    prompts, responses, ids = render_rows(dataset, tokenizer, run)
    if not ids:
        raise DataError(f"{ds_cfg.dataset} has no rows to score")
    if policy.max_model_len is not None:  # keep the last tokens: the reward is read at the final one
        ids = [x[-policy.max_model_len :] for x in ids]
    scorer = SampleScorer.load(
        policy.pretrain,
        tokenizer,
        value_head_prefix=run.scoring.value_head_prefix,
        normalize_reward=run.scoring.normalize_reward,
        param_dtype=policy.param_dtype,
        micro_batch_size=run.scoring.micro_batch_size or DEFAULT_MICRO_BATCH,
        flag="--pretrain",
    )
    rewards = scorer(ids)
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / max(len(rewards) - 1, 1))
    log.info("scored %d responses: reward mean %.4f, std %.4f", len(rewards), mean, std)
    groups = group_by_prompt(prompts, responses, rewards)
    process = make_post_processor(run.scoring.post_processor, run.scoring.template)
    path = Path(cfg.output_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with path.open("w", encoding="utf-8") as out:
        for group in groups:
            for row in process(group):
                row = {cfg.output_key if k == "output" else k: v for k, v in row.items()}
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
                written += 1
    return GenerateResult(path, len(groups), len(rewards), written, mean)


def render_rows(dataset, tokenizer, run: GenerateRun) -> tuple[list[str], list, list[list[int]]]:
    """Each row's rendered prompt, its response as in the file, and the token ids the reward model
    scores (prompt then response, rendered as reward-model training data)."""
    from tidal.data import DataError
    from tidal.data.loading import require_keys
    from tidal.data.rows import row_name
    from tidal.data.templates import render_prompt, render_response, tokenize_texts

    cfg, source = run.prompts, run.datasets.dataset
    # OpenRLHF reads a chat without an --output_key column as prompt turns then the response (its last turn)
    whole_chats = cfg.apply_chat_template and cfg.output_key not in (dataset.column_names or ())
    require_keys(dataset, [cfg.input_key] if whole_chats else [cfg.input_key, cfg.output_key], source)
    prompts, responses, texts = [], [], []
    for i, row in enumerate(dataset):
        try:
            if whole_chats:
                value, response = split_last_turn(row[cfg.input_key], cfg.input_key)
            else:
                value, response = row[cfg.input_key], row[cfg.output_key]
            if value is None or response is None:
                missing = cfg.input_key if value is None else cfg.output_key
                raise DataError(f"no value for key {missing!r}")
            prompt = render_prompt(value, tokenizer, cfg.input_template, cfg.apply_chat_template)
            text = prompt + render_response(value, response, tokenizer, prompt, cfg.apply_chat_template)
        except DataError as err:
            raise DataError(f"{row_name(dataset, i, source)}: {err}") from err
        prompts.append(prompt)
        responses.append(response)
        texts.append(text)
    ids = [list(x) for x in tokenize_texts(tokenizer, texts, cfg.apply_chat_template)["input_ids"]]
    return prompts, responses, ids


def split_last_turn(chat, key: str) -> tuple[list, str]:
    """A conversation → (its turns before the last, the last turn's text): the response to score."""
    from tidal.data import DataError

    if not (isinstance(chat, list) and len(chat) > 1 and all(isinstance(m, dict) for m in chat)):
        raise DataError(
            f"{key!r} must be a conversation (a list of two or more messages) when the file has no "
            "--output_key column; pass --output_key for a separate response"
        )
    return chat[:-1], chat[-1].get("content")


def group_by_prompt(prompts: list[str], responses: list, rewards: list[float]) -> list[PromptGroup]:
    """One group per distinct prompt text, in order of first appearance (as OpenRLHF groups rows)."""
    groups: dict[str, PromptGroup] = {}
    for prompt, response, reward in zip(prompts, responses, rewards, strict=True):
        group = groups.setdefault(prompt, PromptGroup(prompt, [], []))
        group.outputs.append(response)
        group.rewards.append(reward)
    return list(groups.values())
