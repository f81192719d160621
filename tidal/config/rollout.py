"""The rollout's config (``--vllm_*``, sampling and length flags): what tidal's own engine is built with
and how each prompt is sampled. Split from ``tidal.config.rl`` (which re-exports it) to keep files short.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config.args import AT_LEAST_ONE, NON_NEGATIVE, Checked, Range, arg

# --rollout_quantization values (tidal.rollout.quant.QUANTIZATIONS, written here: --help imports no torch)
ROLLOUT_QUANTIZATIONS = ("none", "fp8", "fp8_block")
# --rollout_kv_cache_dtype values (EngineConfig.kv_cache_dtype's too: runner/kv_cache.py imports them)
KV_CACHE_DTYPES = ("auto", "fp8")

# OpenRLHF v0.9.2's prompt and response limits, used when neither they nor --max_len are set.
DEFAULT_PROMPT_MAX_LEN = 1024
DEFAULT_GENERATE_MAX_LEN = 1024


def kv_cache_dtype_arg() -> str:
    """``--rollout_kv_cache_dtype`` (alias ``--kv_cache_dtype``, vLLM's name) of every command with an engine:
    ``tidal ppo`` and the commands that only sample (``tidal serve``, ``generate``, ``chat``)."""
    return arg(
        "auto",
        help="KV cache of tidal's engine (vLLM's --kv_cache_dtype): fp8 stores keys and values as FP8 e4m3 "
        "with a scale per token and head: 1.94x the tokens in the same memory, for when the cache bounds how "
        "many sequences decode together (a decode step's attention is slower: docs/benchmarks.md); log-probs "
        "move as with --rollout_quantization; auto: the model dtype. Not with --exact_logprobs or tensor "
        "parallelism, nor for Gemma, gpt-oss or DeepSeek-V3",
        choices=KV_CACHE_DTYPES,
        aliases=["--kv_cache_dtype"],
        engine="kv_cache_dtype",  # tidal.rollout.runner.kv_cache
    )


@dataclass
class RolloutConfig(Checked):
    """Rollout: sampling and tidal's generation engine (``--vllm_*`` flags configure it)."""

    rollout_batch_size: int = arg(
        1024, help="prompts per rollout (each gets --n_samples_per_prompt samples)", check=AT_LEAST_ONE
    )
    n_samples_per_prompt: int = arg(1, help="samples generated per prompt", check=AT_LEAST_ONE)
    micro_rollout_batch_size: int = arg(
        8, help="samples per forward when scoring a rollout (log-probs, values)", check=AT_LEAST_ONE
    )
    prompt_max_len: int | None = arg(
        None,
        help="prompts longer than this many tokens are skipped (unset: 1024, or --max_len - 1 when --max_len "
        "is set: OpenRLHF >= v0.10 has no prompt limit of its own)",
        check=AT_LEAST_ONE,
    )
    generate_max_len: int | None = arg(
        None,
        help="max new tokens per response (per turn for agents; unset: 1024, or with --max_len whatever the "
        "prompt leaves of it, OpenRLHF >= v0.10's budget)",
        check=AT_LEAST_ONE,
    )
    max_len: int | None = arg(
        None,
        help="max total tokens of a trajectory, prompt + response (unset: prompt_max_len + generate_max_len); "
        "each response gets what its prompt leaves",
        check=Range(2),
    )
    temperature: float = arg(1.0, help="sampling temperature (0: greedy)", check=NON_NEGATIVE)
    top_p: float = arg(1.0, help="nucleus sampling", check=Range(0, 1, low_open=True))
    top_k: int = arg(-1, help="top-k sampling (-1: off)", check=Range(1, also=(-1, 0)))
    eval_temperature: float = arg(0.6, help="sampling temperature for evaluation", check=NON_NEGATIVE)
    eval_n_samples_per_prompt: int = arg(
        4, help="samples per prompt for evaluation (k of the logged eval/pass@k)", check=AT_LEAST_ONE
    )
    eval_pass_threshold: float = arg(
        1.0, help="an evaluation sample passes (eval/pass@1, eval/pass@k) when its score is >= this"
    )
    vllm_num_engines: int | None = arg(
        None,
        help="rollout engines on devices of their own, a multiple of the policy workers (with "
        "--colocate_all_models: one per policy worker, sharing its device); unset: one per policy worker",
    )
    vllm_tensor_parallel_size: int = arg(
        1,
        help="devices (processes) per engine: tensor parallelism; engines on devices of their own, or "
        "local mode's one engine",
        engine="tp_size",
    )
    vllm_gpu_memory_utilization: float = arg(
        0.5,
        help="fraction of free GPU memory the engine's KV cache may use",
        check=Range(0, 1, low_open=True),
    )
    vllm_generate_batch_size: int | None = arg(
        None,
        help="prompts a generation call starts with (unset: --rollout_batch_size); more than "
        "--rollout_batch_size over-samples, the extra groups feeding later steps (--async_train); as in "
        "OpenRLHF it does not size the engine's batch (at most 256 sequences decode together)",
        check=AT_LEAST_ONE,
    )
    vllm_sync_backend: str = arg(
        "nccl",
        help="weight sync backend: colocated engines gather weights over the training process group, "
        "separate engines receive a bucketed broadcast (nccl on CUDA; on CPU only gloo exists and is used)",
        choices=("nccl", "gloo"),
    )
    vllm_sync_with_ray: bool = arg(
        False, help="not supported: weights travel over torch process groups (NCCL/gloo), not Ray"
    )
    vllm_enable_sleep: bool = arg(False, help="free the engine's KV cache while training (colocated models)")
    enforce_eager: bool = arg(False, help="run the engine without CUDA graphs", engine="enforce_eager")
    enable_prefix_caching: bool = arg(
        False,
        help="reuse the engine's cached KV blocks of prompt prefixes already computed (shared system prompts, "
        "the history of multi-turn episodes); invalidated at each weight update",
        engine="enable_prefix_caching",
    )
    moe_router_replay: bool = arg(
        False,
        help="MoE policies: the engine records each token's experts and the trainer's forwards reuse them "
        "(routing weights from the trainer's router); decode then runs without CUDA graphs",
        engine="record_routing",  # the experts the trainer replays
    )
    exact_logprobs: bool = arg(
        False,
        help="exact on-policy log-probs: the engine and the policy run batch-invariant ops "
        "(tidal.rollout.batch_invariant), so the rollout's log-probs equal the trainer's bit for bit and the "
        "old-log-prob forward is skipped (Llama, Mistral, Qwen2, Qwen3; on the CPU also Qwen3-MoE, Mixtral, "
        "Qwen2-MoE; LoRA with --lora_dropout 0; FSDP2 and separate engines; not with "
        "--vllm_tensor_parallel_size > 1)",
        engine="exact_logprobs",  # the policy's forward runs the same ops (PPOTrainer)
    )
    rollout_quantization: str = arg(
        "none",
        help="FP8 rollouts (tidal): the engine quantizes its linear layers and MoE experts to FP8 e4m3 on "
        "the device at load and at every weight sync, with per-output-channel scales (fp8) or 128x128 "
        "block scales (fp8_block); embeddings, norms, routers, the LM head and the KV cache keep the model "
        "dtype; the trainer is unchanged, its TIS/ICEPOP corrections and rollout/ mismatch metrics cover "
        "the gap (not with --exact_logprobs or --vllm_tensor_parallel_size > 1)",
        choices=ROLLOUT_QUANTIZATIONS,
        engine="quantization",  # tidal.rollout.quant
    )
    rollout_kv_cache_dtype: str = kv_cache_dtype_arg()  # --kv_cache_dtype too
    partial_rollout_enable: bool = arg(
        False, aliases=["--partial_rollout"],
        help="with --async_train: a weight update lands between engine steps of the rollout in progress, its "
        "sequences going on under the new weights (one process, the local engine, single-turn text)",
    )  # fmt: skip

    def __post_init__(self) -> None:
        # Resolve the unset lengths: OpenRLHF v0.9.2 sets the prompt and response limits (1024 each);
        # from v0.10 only --max_len (HEAD's --data.max_len) bounds prompt + response, and a response gets
        # what its prompt leaves (the executors cap each request's new tokens at max_len - prompt length).
        room = self.max_len - 1 if isinstance(self.max_len, int) and self.max_len >= 2 else None
        # the flags as given (unset stays unset as a flag default: tidal.config.args.flag_default)
        self.flag_values = {"prompt_max_len": self.prompt_max_len, "generate_max_len": self.generate_max_len}
        if self.prompt_max_len is None:
            self.prompt_max_len = room or DEFAULT_PROMPT_MAX_LEN
        if self.generate_max_len is None:
            self.generate_max_len = room or DEFAULT_GENERATE_MAX_LEN
        super().__post_init__()

    def problems(self, flags=None) -> list[str]:
        own = []
        if self.exact_logprobs and self.vllm_tensor_parallel_size > 1:
            own.append("--exact_logprobs needs --vllm_tensor_parallel_size 1")
        if self.rollout_quantization != "none" and self.exact_logprobs:
            own.append(
                "--exact_logprobs cannot run with --rollout_quantization: the engine's log-probs are then the "
                "FP8 policy's, never bit-equal to the trainer's"
            )
        if self.rollout_quantization != "none" and self.vllm_tensor_parallel_size > 1:
            own.append("--rollout_quantization needs --vllm_tensor_parallel_size 1")
        if self.rollout_kv_cache_dtype == "fp8" and self.exact_logprobs:
            own.append(
                "--exact_logprobs cannot run with --rollout_kv_cache_dtype fp8: the engine's attention then reads "
                "FP8-rounded keys and values, never the trainer's"
            )
        if self.rollout_kv_cache_dtype == "fp8" and self.vllm_tensor_parallel_size > 1:
            own.append("--rollout_kv_cache_dtype fp8 needs --vllm_tensor_parallel_size 1")
        if self.max_len is not None and self.max_len <= self.prompt_max_len:
            own.append(
                f"--max_len {self.max_len} leaves no room for a response after --prompt_max_len {self.prompt_max_len}"
            )
        return super().problems(flags) + own

    @property
    def total_len(self) -> int:
        return self.max_len or self.prompt_max_len + self.generate_max_len
