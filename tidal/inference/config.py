"""Configs of ``tidal generate`` and ``tidal chat``: the policy and its engine, sampling, prompts, scoring.

Each dataclass is one ``--help`` group (``tidal.config.args``). Cross-flag checks live in
``validate`` methods and raise ``ConfigError`` naming the flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidal.config.args import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, ConfigError, Range, arg
from tidal.config.engine import ENGINE_DTYPES, engine_config, engine_knobs
from tidal.config.rollout import kv_cache_dtype_arg
from tidal.config.serve import quantization_arg
from tidal.inference.processors import DEFAULT_REWARD_TEMPLATE, POST_PROCESSORS, check_reward_template

if TYPE_CHECKING:  # tidal.rollout imports torch: these configs build --help, the engine loads on a run
    from tidal.rollout import EngineConfig, SamplingParams

DEFAULT_CSFT_PROMPT = "<rm_score>: 5.00"  # OpenRLHF's
ITER_SLICE = 2048  # OpenRLHF's --rollout_batch_size default: the prompts of one --iter
CHUNK_SEQS_PER_SLOT = 4  # without --rollout_batch_size: samples per engine call per --max_num_seqs slot


def csft_prompt_suffix(csft_prompt: str) -> str:
    """What ``--enable_csft`` appends to a rendered prompt (OpenRLHF's: the stripped prompt and a space)."""
    return csft_prompt.strip() + " "


@dataclass
class PolicyConfig:
    """Model: the checkpoint to sample from and tidal's rollout engine that runs it."""

    pretrain: str = arg(help="HF model folder (or hub name) to sample from (required)", metavar="PATH")
    param_dtype: str = arg(
        "auto", help="engine dtype (auto: bf16 on CUDA, fp32 on CPU)", choices=tuple(ENGINE_DTYPES)
    )
    max_num_seqs: int = arg(
        256,
        help="sequences the engine decodes together (continuous batching)",
        aliases=["--vllm_generate_batch_size"],
    )
    max_model_len: int | None = arg(
        None, help="prompt + response tokens per sequence (default: the model's max_position_embeddings)"
    )
    gpu_memory_utilization: float = arg(
        0.5,
        help="CUDA: share of free memory (after weights) for the KV cache",
        aliases=["--vllm_gpu_memory_utilization"],
    )
    tokenizer_chat_template: str | None = arg(None, help="Jinja chat template that replaces the tokenizer's")
    disable_fast_tokenizer: bool = arg(False, help="load the slow (Python) tokenizer")
    tp_size: int = arg(
        1,
        help="tensor-parallel size of the engine: processes it spans, on the CPU or on that many GPUs "
        "(OpenRLHF's default is every visible GPU; tidal's is 1)",
        check=AT_LEAST_ONE,
        engine="tp_size",
    )
    enable_prefix_caching: bool = arg(
        False,
        help="reuse the engine's cached KV blocks of prompt prefixes already computed (e.g. a shared "
        "system prompt, or the n samples of earlier prompts)",
        engine="enable_prefix_caching",
    )
    rollout_quantization: str = quantization_arg()  # --quantization too
    rollout_kv_cache_dtype: str = kv_cache_dtype_arg()  # --kv_cache_dtype too

    def engine_config(self, seed: int) -> EngineConfig:
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"--max_model_len must be >= 2, got {self.max_model_len}")
        return engine_config(
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            gpu_memory_utilization=self.gpu_memory_utilization,
            seed=seed,
            param_dtype=self.param_dtype,  # no trainer here: the flag sets the engine's dtype
            **engine_knobs(self),  # --tp_size, --enable_prefix_caching, --rollout_quantization
        )


@dataclass
class SamplingConfig:
    """Sampling: response length and randomness (temperature 0 is greedy)."""

    max_new_tokens: int = arg(
        1024, help="max tokens per response", aliases=["--generate_max_len"], check=AT_LEAST_ONE
    )
    temperature: float = arg(1.0, help="sampling temperature (0: greedy)", check=NON_NEGATIVE)
    top_p: float = arg(
        1.0,
        help="nucleus sampling: keep the most likely tokens up to this probability mass",
        check=Range(0, 1, low_open=True),
    )
    top_k: int = arg(-1, help="keep the k most likely tokens (-1: off)", check=Range(1, also=(-1, 0)))
    seed: int = arg(1234, help="random seed: the same seed, data and flags give the same samples")
    repetition_penalty: float = arg(
        1.0,
        help="divide the logit of every token already in the prompt or response by this when positive, "
        "multiply when negative (as transformers and vLLM; > 1 discourages repeats, 1: off)",
        check=POSITIVE,
    )

    def sampling_params(self, n: int = 1) -> SamplingParams:
        from tidal.rollout import SamplingParams  # torch: only when sampling, not for --help

        try:
            return SamplingParams(
                n=n,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                max_new_tokens=self.max_new_tokens,
                repetition_penalty=self.repetition_penalty,
            )
        except ValueError as err:  # SamplingParams' messages use the field names, which are the flags
            raise ConfigError("--" + str(err).replace("SamplingParams: ", "")) from err


@dataclass
class GeneratePromptConfig:
    """Prompts and output: which key holds the prompt, how it is rendered, where samples go."""

    output_path: str = arg(help="JSONL file to write, one object per line (required)", metavar="FILE")
    input_key: str = arg("input", help="dataset key of the prompt (text, or chat messages)")
    input_template: str | None = arg(
        None, help="template with '{}' for the prompt, e.g. $'User: {}\\nAssistant: '"
    )
    apply_chat_template: bool = arg(False, help="render prompts with the tokenizer's chat template")
    prompt_max_len: int = arg(
        1024, help="prompts longer than this many tokens are skipped (and counted)", check=AT_LEAST_ONE
    )
    n_samples_per_prompt: int = arg(
        1, help="responses sampled per prompt (K); --best_of_n is the same flag", aliases=["--best_of_n"]
    )
    label_key: str | None = arg(None, help="dataset key of the label handed to --eval_task's reward_func")
    output_key: str = arg(
        "output", help="key of the response in the written rows (iter_dpo rows have chosen/rejected)"
    )
    enable_csft: bool = arg(False, help="conditional SFT: end every prompt with --csft_prompt")
    csft_prompt: str = arg(
        DEFAULT_CSFT_PROMPT, help="--enable_csft: appended to each prompt (stripped, then one space)"
    )
    iter: int | None = arg(
        None,
        help="iterative DPO: sample only the prompts of iteration ITER, dataset rows "
        "[ITER x --rollout_batch_size, (ITER + 1) x --rollout_batch_size)",
        check=NON_NEGATIVE,
    )
    rollout_batch_size: int | None = arg(
        None,
        help=f"prompts handed to the engine per call (the progress bar and the output file advance by "
        f"these), and --iter's slice size (unset: {ITER_SLICE} for --iter; without it, about "
        f"{CHUNK_SEQS_PER_SLOT} x --max_num_seqs samples' worth)",
        check=AT_LEAST_ONE,
    )

    @property
    def iter_rows(self) -> range | None:
        """The dataset rows ``--iter`` selects (None: every row)."""
        if self.iter is None:
            return None
        size = self.rollout_batch_size or ITER_SLICE
        return range(self.iter * size, (self.iter + 1) * size)

    def validate(self) -> None:
        if self.csft_prompt != DEFAULT_CSFT_PROMPT and not self.enable_csft:
            raise ConfigError("--csft_prompt is appended to the prompts by --enable_csft: pass it too")
        if self.n_samples_per_prompt < 1:
            raise ConfigError(
                f"--n_samples_per_prompt/--best_of_n must be >= 1, got {self.n_samples_per_prompt}"
            )
        if self.prompt_max_len < 1:
            raise ConfigError(f"--prompt_max_len must be >= 1, got {self.prompt_max_len}")


@dataclass
class ScoringConfig:
    """Reward model and post-processing: score every sample, then keep/shape rows (rs, csft, iter_dpo)."""

    reward_pretrain: str | None = arg(
        None, help="reward model folder (tidal rm) that scores each prompt+response", metavar="PATH"
    )
    value_head_prefix: str = arg(
        "score", help="attribute name of the reward model's value head", aliases=["--value_prefix_head"]
    )
    normalize_reward: bool = arg(
        False, help="rewards are (score - mean) / std with the mean/std stored by tidal rm --normalize_reward"
    )
    micro_batch_size: int | None = arg(None, help="sequences per reward-model forward (unset: 16)")
    post_processor: str | None = arg(
        None,
        help="rs: best sample per prompt; csft: every sample with its reward in the prompt; "
        "iter_dpo: best/worst sample as chosen/rejected",
        choices=tuple(POST_PROCESSORS),
    )
    reward_template: str | None = arg(
        None,
        help=f"csft: how the reward enters the prompt, with {{input}} and {{reward}} "
        f"(reward written with one decimal; unset: {DEFAULT_REWARD_TEMPLATE!r})",
    )
    csft_reward: float | None = arg(
        None, help="condition generation on this reward: prompts are rendered with --reward_template"
    )
    eval_task: str | None = arg(
        None,
        help="evaluate: score every sample with this reward function (a .py file defining reward_func, "
        "as --remote_rm_url) or reward server URL, and report pass@1, pass@k and the mean reward",
        metavar="PATH|URL",
    )
    eval_pass_threshold: float = arg(
        1.0, help="--eval_task: a sample passes (pass@1, pass@k) when its score is >= this"
    )

    @property
    def template(self) -> str:
        return self.reward_template or DEFAULT_REWARD_TEMPLATE

    def validate(self, n_samples: int) -> None:
        if self.eval_task is not None:
            check_eval_task(self.eval_task)
            if self.reward_pretrain is not None:
                raise ConfigError(
                    "--eval_task and --reward_pretrain both score the samples: pass one of them"
                )
        elif self.eval_pass_threshold != 1.0:
            raise ConfigError(
                "--eval_pass_threshold needs --eval_task (a reward function to score the samples)"
            )
        if self.reward_pretrain is None:
            needs_rm = [
                (
                    self.post_processor is not None and self.eval_task is None,
                    f"--post_processor {self.post_processor}",
                ),
                (self.normalize_reward, "--normalize_reward"),
                (self.value_head_prefix != "score", "--value_head_prefix"),
                (self.micro_batch_size is not None, "--micro_batch_size"),
            ]
            for given, flag in needs_rm:
                if given:
                    raise ConfigError(f"{flag} needs --reward_pretrain (a reward model to score the samples)")
        if self.post_processor == "iter_dpo" and n_samples < 2:
            raise ConfigError(
                f"--post_processor iter_dpo picks a best and a worst sample per prompt: "
                f"set --best_of_n (or --n_samples_per_prompt) >= 2, got {n_samples}"
            )
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ConfigError(f"--micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.reward_template is not None:
            if self.post_processor != "csft" and self.csft_reward is None:
                raise ConfigError("--reward_template is only used by --post_processor csft and --csft_reward")
            check_reward_template(self.reward_template)


def check_eval_task(value: str) -> None:
    """``--eval_task`` names a reward function (``.py``) or server (``http(s)://``). OpenRLHF's
    batch-inference modes under the same flag (generate, generate_vllm, rm) are not tasks here:
    ``tidal generate`` always generates, and scores with a reward model through --reward_pretrain."""
    v = value.strip()
    if v.endswith(".py") or v.startswith(("http://", "https://")):
        return
    raise ConfigError(
        f"--eval_task {value!r}: expected a reward function file (.py defining reward_func) or a reward "
        "server URL; OpenRLHF's modes (generate, generate_vllm) are what tidal generate always does "
        "(drop the flag), and reward-model scoring is --reward_pretrain"
    )
