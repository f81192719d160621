"""Batch inference (``tidal generate``): sample K responses per prompt, score, post-process, write JSONL.

Pipeline: load and render the prompts (``tidal.data``: ``--input_key``, ``--input_template``,
``--apply_chat_template``), tokenize them with the shared rule of ``tidal.data.templates``, sample
with tidal's ``LLMEngine`` (never ``transformers.generate``), optionally score every prompt+response
with a reward model (``scoring.SampleScorer``) or an evaluation task (``--eval_task``: a reward
function, whose scores give pass@1 and pass@k, ``evaluation``), turn each prompt's samples into rows
with a post-processor (``processors``), and append the rows to ``--output_path``.

``--iter`` keeps only one iteration's slice of the dataset rows (iterative DPO, as OpenRLHF), and
``--enable_csft`` ends every prompt with ``--csft_prompt`` (conditional SFT; the reward model still
scores the answer to the plain prompt).

Images (``--image_key``, ``--max_images_per_prompt``; a vision-language ``--pretrain``): each row's images
are read and checked up front as for training (``tidal.data.images.check_image_rows``), and go to the
engine with their prompt (``tidal.rollout.runner.multimodal.MultiModalInput``); each image's marker is
laid out in the prompt's ids as the model's processor does (``tidal.data.vision.ImageMarkup``), so the
engine takes them as they are; the output rows are written as for text (the rendered prompt holds one
marker per image).

Prompts go through the engine in chunks of ``--rollout_batch_size`` prompts (unset: about
``CHUNK_SEQS_PER_SLOT × --max_num_seqs`` samples); the file grows and is flushed chunk by chunk (a long run can be watched, and an interrupted one keeps
the finished chunks), while a chunk is still large enough that continuous batching keeps the engine
full until its tail drains. ``input`` in the output is the prompt exactly as the model saw it
(rendered), so a training step on the file must not render it again.

A model whose logits are not finite (NaN weights) samples token 0 with a NaN log-prob at every step and
"answers" with empty text; ``check_finite_samples`` looks at the sampled log-probs the engine returns
with each chunk (already on the host: no extra device work) and stops with one line naming the model,
before that chunk is written.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from tidal.checkpoint.resumable import CheckpointError
from tidal.config.args import ConfigError
from tidal.config.data import DatasetConfig, VisionConfig
from tidal.data import DataError, build_prompt_samples, tokenize_texts
from tidal.inference.config import (
    CHUNK_SEQS_PER_SLOT,
    GeneratePromptConfig,
    PolicyConfig,
    SamplingConfig,
    ScoringConfig,
    csft_prompt_suffix,
)
from tidal.inference.evaluation import pass_at_k_stats
from tidal.inference.processors import PromptGroup, make_post_processor, reward_tag
from tidal.inference.scoring import SampleScorer
from tidal.logging import get_logger
from tidal.rewards import load_reward_source
from tidal.rollout import LLMEngine, make_engine
from tidal.rollout.models.registry import VISION_FAMILIES

log = get_logger(__name__)


@dataclass
class GenerateRun:
    """Everything ``tidal generate`` was asked to do."""

    policy: PolicyConfig
    sampling: SamplingConfig
    prompts: GeneratePromptConfig
    scoring: ScoringConfig
    datasets: DatasetConfig
    vision: VisionConfig = field(default_factory=VisionConfig)

    def validate(self) -> None:
        self.prompts.validate()
        self.scoring.validate(self.prompts.n_samples_per_prompt)
        if self.prompts.label_key is not None and self.scoring.eval_task is None:
            raise ConfigError("--label_key is read by --eval_task's reward_func: pass --eval_task too")
        n = self.prompts.n_samples_per_prompt
        if n > self.policy.max_num_seqs:
            raise ConfigError(
                f"--best_of_n/--n_samples_per_prompt {n} exceeds --max_num_seqs {self.policy.max_num_seqs}"
            )
        self.sampling.sampling_params(n)  # raises ConfigError on bad sampling flags
        if self.prompts.enable_csft and self.scoring.csft_reward is not None:
            raise ConfigError(
                "--enable_csft (a fixed --csft_prompt) and --csft_reward (a reward in --reward_template) "
                "both condition the prompts: pass one of them"
            )
        if self.prompts.output_key != "output" and self.scoring.post_processor == "iter_dpo":
            raise ConfigError(
                "--output_key: --post_processor iter_dpo writes 'chosen' and 'rejected', no response key"
            )


@dataclass
class GenerateResult:
    output_path: Path
    prompts: int
    samples: int
    rows: int
    mean_reward: float | None
    eval: dict[str, float] | None = None  # --eval_task: pass@1, pass@k and the mean reward


def run_generate(run: GenerateRun) -> GenerateResult:
    """Generate, score and write; returns counts for the caller's summary."""
    run.validate()
    n = run.prompts.n_samples_per_prompt
    if n > 1 and run.sampling.temperature == 0:
        log.warning("--temperature 0 is greedy: the %d samples of each prompt will be identical", n)
    dataset = load_rows(run)  # before the engine: a bad --iter or dataset fails in seconds, not after a load
    engine = load_engine(run.policy, run.sampling.seed)
    scorer = None
    if run.scoring.reward_pretrain:
        scorer = SampleScorer.load(
            run.scoring.reward_pretrain,
            engine.tokenizer,
            value_head_prefix=run.scoring.value_head_prefix,
            normalize_reward=run.scoring.normalize_reward,
            param_dtype=run.policy.param_dtype,
            micro_batch_size=run.scoring.micro_batch_size or 16,
            device=engine.device,
        )
    task = load_reward_source(run.scoring.eval_task) if run.scoring.eval_task else None
    prompts = load_prompts(
        run, dataset, engine.tokenizer, engine.max_model_len, vision_processor(run, engine)
    )
    return write_samples(run, engine, scorer, prompts, task=task)


def load_engine(policy: PolicyConfig, seed: int) -> LLMEngine:
    from tidal.config.model import ModelConfig
    from tidal.models import load_tokenizer

    config = policy.engine_config(seed)
    tokenizer = load_tokenizer(
        policy.pretrain,
        ModelConfig(
            pretrain=policy.pretrain,
            disable_fast_tokenizer=policy.disable_fast_tokenizer,
            tokenizer_chat_template=policy.tokenizer_chat_template,
        ),
    )
    try:
        engine = make_engine(policy.pretrain, config, tokenizer=tokenizer)
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(
            f"--pretrain {policy.pretrain}: cannot load it into the rollout engine ({err})"
        ) from err
    return engine


def vision_processor(run: GenerateRun, engine: LLMEngine):
    """The model's ``VisionProcessor`` (None for a text model), after the image flags are checked
    against the model (one line when they do not fit)."""
    from tidal.data.vision import ImageSamples, load_vision_processor

    if run.vision.freeze_visual_encoder:
        raise ConfigError(
            "--freeze_visual_encoder is a training flag; tidal generate trains nothing: drop it"
        )
    processor = load_vision_processor(run.policy.pretrain, engine.tokenizer)
    ImageSamples(run.vision, processor).check(run.policy.pretrain, tensor_parallel_size=1)
    if run.vision.max_images_per_prompt and getattr(engine, "vision", None) is None:
        raise ConfigError(
            f"--max_images_per_prompt {run.vision.max_images_per_prompt}: the rollout engine serving "
            f"{run.policy.pretrain} does not take images (the engine's vision families do: "
            f"{', '.join(sorted(VISION_FAMILIES))})"
        )
    return processor


@dataclass
class Prompts:
    """Rendered prompts, the ids the policy is conditioned on, and the ids the reward model sees
    before each response (the same, except that ``--csft_reward``'s tag is left out: the reward
    model judges the answer to the question, not to the quality tag), and the ``--label_key`` labels
    (None without it) that ``--eval_task`` sees."""

    texts: list[str]
    ids: list[list[int]]
    scored_ids: list[list[int]]
    labels: list
    images: list | None = None  # each prompt's ImageRefs (vision-language models), else None

    def select(self, rows) -> Prompts:
        fields = (self.texts, self.ids, self.scored_ids, self.labels)
        images = None if self.images is None else [self.images[i] for i in rows]
        return Prompts(*([field[i] for i in rows] for field in fields), images=images)

    def multi_modal(self) -> list | None:
        """The engine's per-prompt images (``MultiModalInput``; None for a prompt without images)."""
        if self.images is None:
            return None
        from tidal.data.images import open_image
        from tidal.rollout.runner.multimodal import MultiModalInput

        return [
            MultiModalInput(images=[open_image(r) for r in refs]) if refs else None for refs in self.images
        ]


def load_rows(run: GenerateRun):
    """The dataset rows this run generates for (``--iter`` selects a slice)."""
    # here, not at the top: ``datasets`` costs ~1 s of start-up, and ``tidal chat`` imports this module
    # for ``load_engine`` only
    from tidal.data import load_dataset_spec

    ds_cfg, cfg = run.datasets, run.prompts
    dataset = load_dataset_spec(
        ds_cfg.dataset, ds_cfg.dataset_probs, ds_cfg.dataset_split, ds_cfg.max_samples, run.sampling.seed
    )
    rows = cfg.iter_rows
    if rows is None:
        return dataset
    if rows.start >= len(dataset):
        raise DataError(
            f"--iter {cfg.iter} selects rows {rows.start}..{rows.stop - 1} of {ds_cfg.dataset}, which "
            f"has {len(dataset)} rows (--rollout_batch_size {rows.stop - rows.start} per iteration)"
        )
    return dataset.select(range(rows.start, min(rows.stop, len(dataset))))


def load_prompts(run: GenerateRun, dataset, tokenizer, max_model_len: int, processor=None) -> Prompts:
    """Rendered prompts and their token ids; over-long prompts are skipped and counted."""
    ds_cfg, cfg = run.datasets, run.prompts
    samples, _ = build_prompt_samples(
        dataset,
        tokenizer,
        cfg.input_key,
        label_key=cfg.label_key,
        input_template=cfg.input_template,
        apply_chat_template=cfg.apply_chat_template,
        source=ds_cfg.dataset,
    )
    plain = [s.prompt for s in samples]
    texts = plain
    if run.scoring.csft_reward is not None:
        texts = [reward_tag(run.scoring.template, t, run.scoring.csft_reward) for t in plain]
    if cfg.enable_csft:
        texts = [t + csft_prompt_suffix(cfg.csft_prompt) for t in plain]
    ids = [list(x) for x in tokenize_texts(tokenizer, texts, cfg.apply_chat_template)["input_ids"]]
    scored = (
        ids
        if texts is plain
        else [list(x) for x in tokenize_texts(tokenizer, plain, cfg.apply_chat_template)["input_ids"]]
    )
    images = None
    if processor is not None:  # every row's images checked (and measured in tokens) before any sampling
        images, ids = _image_rows(run, dataset, processor, texts)
    lengths = [len(x) for x in ids]
    # the engine needs room for at least one new token after the prompt
    kept = _prompts_that_fit(lengths, min(cfg.prompt_max_len, max_model_len - 1), ds_cfg.dataset)
    labels = [s.label for s in samples]
    return Prompts(texts, ids, scored, labels, images).select(kept)


def _image_rows(run: GenerateRun, dataset, processor, texts: list[str]) -> tuple[list, list[list[int]]]:
    """Each row's checked image refs, and the policy's prompt ids with each image's marker laid out on the
    text as the model's processor does (``ImageMarkup.expand_text``: the image's token count, Gemma's
    begin/end of image), so that the engine takes them as they are and their lengths are the prompts'."""
    from tidal.data.images import check_image_rows

    source = run.datasets.dataset
    rows_images = check_image_rows(dataset, run.vision, source, processor.token_counts)
    markup, laid_out = processor.image_markup, []
    for i, (text, row) in enumerate(zip(texts, rows_images, strict=True)):
        try:
            laid_out.append(markup.expand_text(text, row.token_counts))
        except ValueError as err:
            raise DataError(
                f"row {i + 1} of {source}: {err} (each image needs one {markup.marker!r}: a "
                "{'type': 'image'} content part)"
            ) from err
    ids = tokenize_texts(processor.tokenizer, laid_out, run.prompts.apply_chat_template)["input_ids"]
    return [row.refs for row in rows_images], [list(x) for x in ids]


def _prompts_that_fit(lengths: list[int], limit: int, dataset: str) -> list[int]:
    """The indices of the prompts of at most ``limit`` tokens. Longer ones are skipped (logged), never
    truncated: a truncated question is another question."""
    skipped = [i for i, n in enumerate(lengths) if n > limit]
    if len(skipped) == len(lengths):
        raise DataError(f"every prompt of {dataset} is longer than {limit} tokens (--prompt_max_len)")
    if skipped:
        log.warning(
            "skipped %d prompt(s) longer than %d tokens; first rows: %s", len(skipped), limit, skipped[:10]
        )
    return [i for i, n in enumerate(lengths) if n <= limit]


def write_samples(run: GenerateRun, engine: LLMEngine, scorer, prompts: Prompts, task=None) -> GenerateResult:
    """Generate chunk by chunk, appending (and flushing) each chunk's rows to ``--output_path``;
    ``task`` (``--eval_task``'s reward source) rewards the samples and its scores give pass@k."""
    n = run.prompts.n_samples_per_prompt
    params = run.sampling.sampling_params(n)
    process = make_post_processor(run.scoring.post_processor, run.scoring.template)
    chunk = run.prompts.rollout_batch_size or max(1, CHUNK_SEQS_PER_SLOT * run.policy.max_num_seqs // n)
    key = run.prompts.output_key
    path = Path(run.prompts.output_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows, rewards, scores, tokens, start = 0, [], [], 0, time.perf_counter()
    with (
        path.open("w", encoding="utf-8") as out,
        tqdm(total=len(prompts.texts), desc="generate", unit="prompt") as bar,
    ):
        for first in range(0, len(prompts.texts), chunk):
            part = prompts.select(range(first, min(first + chunk, len(prompts.texts))))
            results = engine.generate(part.ids, params, **_images_kwargs(part))
            check_finite_samples(results, run.policy.pretrain)
            groups = _groups(part, results, scorer)
            if task is not None:
                scores += _task_scores(task, part, results, groups)
            for group in groups:
                for row in process(group):
                    row = {key if k == "output" else k: v for k, v in row.items()}  # --output_key
                    out.write(json.dumps(row, ensure_ascii=False) + "\n")
                    rows += 1
                rewards += group.rewards or []
            out.flush()
            tokens += sum(len(c.token_ids) for r in results for c in r.outputs)
            bar.update(len(groups))
    elapsed = time.perf_counter() - start
    mean = sum(rewards) / len(rewards) if rewards else None
    log.info(
        "%d prompts x %d samples -> %d rows in %s (%.1f new tokens/s%s)",
        len(prompts.texts), n, rows, path, tokens / max(elapsed, 1e-9),
        f", mean reward {mean:.4f}" if mean is not None else "",
    )  # fmt: skip
    evaluation = None
    if task is not None:
        evaluation = pass_at_k_stats(scores, n, run.scoring.eval_pass_threshold) | {"reward": mean}
        log.info(
            "eval (%s): %s", run.scoring.eval_task, ", ".join(f"{k} {v:.4f}" for k, v in evaluation.items())
        )
    return GenerateResult(path, len(prompts.texts), len(prompts.texts) * n, rows, mean, evaluation)


def _images_kwargs(part: Prompts) -> dict:
    """``generate``'s image argument for a chunk (none for text prompts: every engine takes those)."""
    multi_modal = part.multi_modal()
    return {} if multi_modal is None or not any(multi_modal) else {"multi_modal": multi_modal}


def _groups(prompts: Prompts, results, scorer) -> list[PromptGroup]:
    """One ``PromptGroup`` per prompt; the reward model scores the chunk's samples in one batched call."""
    groups = [
        PromptGroup(t, [c.text for c in r.outputs]) for t, r in zip(prompts.texts, results, strict=True)
    ]
    if scorer is None:
        return groups
    sequences = [
        ids + c.token_ids for ids, r in zip(prompts.scored_ids, results, strict=True) for c in r.outputs
    ]
    scores = iter(scorer(sequences))
    for group in groups:
        group.rewards = [next(scores) for _ in group.outputs]
    return groups


def _task_scores(task, prompts: Prompts, results, groups: list[PromptGroup]) -> list[float]:
    """Reward the chunk's samples with ``--eval_task`` (as RL does: queries are prompt + response);
    the rewards go into the groups (for post-processors), the scores (prompt-major) are returned."""
    pairs = [(t, label, c.text) for t, label, r in zip(prompts.texts, prompts.labels, results, strict=True)
             for c in r.outputs]  # fmt: skip
    result = task(
        [t + text for t, _, text in pairs], [t for t, _, _ in pairs], [label for _, label, _ in pairs]
    )
    rewards = iter(result.rewards.tolist())
    for group in groups:
        group.rewards = [next(rewards) for _ in group.outputs]
    return result.scores.tolist()


def check_finite_samples(results, model: str) -> None:
    """Raise ``CheckpointError`` (an unusable model: exit status 1, one line) when a sampled token's
    log-prob is NaN or +inf, i.e. the model's logits are not finite."""
    for r in results:
        for c in r.outputs:
            bad = next((x for x in c.logprobs or () if math.isnan(x) or x == math.inf), None)
            if bad is not None:
                raise CheckpointError(
                    f"--pretrain {model}: the model's logits are not finite (a sampled token has log-prob {bad}); "
                    "its weights are likely NaN or inf: refusing to write its samples"
                )
