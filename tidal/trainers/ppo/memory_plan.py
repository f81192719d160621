"""What an RL run needs of one GPU, phase by phase, and the flag that makes it fit when it does not.

``plan_memory(shape, settings, capacity)`` is a pure function: from the model's shape (``ModelShape``)
and the run's memory-relevant flags (``MemorySettings``) it adds up, per device, the bytes each
component holds in each phase of an RL step, the way tidal's code holds them:

- the policy trains with master weights in ``--master_dtype`` (``tidal.models.loading``; ``--param_dtype``
  is the compute dtype), gradients and AdamW's two moments in the same dtype: 16 bytes per trained
  parameter in float32, 8 in bf16, sharded over the data-parallel ranks as ``--zero_stage`` says;
  ``--adam_offload`` keeps all three in host memory (FSDP2 ``CPUOffloadPolicy``). With LoRA the frozen
  base keeps its embeddings in the master dtype and its linear weights in the compute dtype;
- the compute copy: autocast's cached bf16 casts of the matmul weights while the forward runs (one
  process; none for weights stored in bf16 already), or FSDP2's gathered bf16 parameters (kept from
  forward to backward unless ``--zero_stage 3``);
- activations of one micro-batch (each decoder layer's input only with ``--gradient_checkpointing``, plus
  one layer recomputed) and the float32 logits of the LM head's chunk (``DEFAULT_CHUNK`` tokens; the whole
  micro-batch for a family whose head is not chunkable);
- the colocated engine: bf16 weights (kept while it sleeps: ``--vllm_enable_sleep`` frees the KV cache;
  ``--rollout_quantization`` fp8: the decoder's linear layers in e4m3, a byte a weight, as the CUDA engine
  frees their bf16 copies) and its KV cache, ``--vllm_gpu_memory_utilization`` of the memory free when it
  starts, at most what its sequences can fill;
- the reference (in the master dtype, on the device unless ``--ref_reward_offload``, which still brings it for its
  forward) when ``--init_kl_coef`` > 0, and the critic (trained like the policy) when the estimator needs one;
- ``--deepspeed_enable_sleep`` moves the policy's (and critic's) weights and optimizer state to host
  memory while the engine generates.

Host memory: with ``--adam_offload`` the training state lives there, with ``--deepspeed_enable_sleep`` the
weights and moments while the engine generates, with ``--ref_reward_offload`` the reference; it must fit
in ``HOST_FRACTION`` of the host memory available (for every training process on the host).

The phases are generate, make experience (no-grad scoring) and train; a run fits when the largest phase
fits in the device's memory less ``RESERVED`` (at most 5% of it: CUDA context, cuBLAS/NCCL workspaces, fragmentation).
``fix_for`` tries the flags that free memory, cheapest first, and names the first that makes the run
fit. ``tidal.trainers.ppo.memory_check`` applies this to a run before anything loads.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

GIB = 2**30
# Kept free: the CUDA context (~0.5 GiB), cuBLAS/NCCL workspaces, allocator fragmentation; at most 5% of a
# device (a test's make-believe device of a few MiB keeps its proportions).
RESERVED = 3 * GIB
RESERVED_FRACTION = 0.05
HOST_FRACTION = 0.9  # of the host's available memory: the process itself, the data, the page cache
LM_HEAD_CHUNK = 2048  # tidal.models.logprob_head.DEFAULT_CHUNK (not imported: this module imports no torch)
KV_BLOCK = 16  # the engine's default KV block size (tokens)
LORA_RANK_ADVICE = 64


@dataclass(frozen=True)
class ModelShape:
    """The sizes that set a decoder-only model's memory (an HF ``config.json``'s fields)."""

    params: int  # every parameter, embeddings included
    layers: int
    hidden: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied_embeddings: bool = False
    chunkable_head: bool = True  # tidal's chunked LM head runs on this family (else full logits)

    @property
    def compute_params(self) -> int:
        """Parameters autocast casts to the compute dtype: all but an untied input embedding (a lookup)."""
        return self.params - (0 if self.tied_embeddings else self.vocab * self.hidden)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, in bf16."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    def lora_params(self, rank: int) -> int:
        """Adapter parameters of rank ``rank`` on every linear layer of the decoder blocks (all-linear)."""
        h, kv, i = self.hidden, self.kv_heads * self.head_dim, self.intermediate
        q = self.heads * self.head_dim
        per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
        return rank * per_layer * self.layers


@dataclass(frozen=True)
class MemorySettings:
    """The flags of ``tidal ppo`` that move memory, as one value (``memory_check.settings_of`` reads a run)."""

    micro_train_batch_size: int
    micro_rollout_batch_size: int
    total_len: int  # prompt + response tokens of a trajectory
    max_num_seqs: int  # sequences the engine decodes together
    gradient_checkpointing: bool = False
    adam_offload: bool = False
    lora_rank: int = 0
    load_in_4bit: bool = False
    compute_bytes: int = 2  # --param_dtype bf16/fp16 (fp32: 4)
    master_bytes: int = 4  # --master_dtype fp32 (bf16: 2)
    zero_stage: int = 2
    dp_size: int = 1
    engine_on_device: bool = True  # a colocated engine (not --vllm_num_engines on devices of their own)
    vllm_enable_sleep: bool = False
    deepspeed_enable_sleep: bool = False
    vllm_gpu_memory_utilization: float = 0.5
    fp8_kv_cache: bool = False  # --rollout_kv_cache_dtype fp8: a byte an element, a float32 scale a row
    fp8_weights: bool = False  # --rollout_quantization fp8/fp8_block: the engine's linear layers in e4m3
    reference: bool = False  # --init_kl_coef > 0 with the reference on this device
    ref_offload: bool = False  # --ref_reward_offload
    critic: bool = False  # an estimator with a critic, on this device
    ranks_per_host: int = 1  # training processes sharing this host's memory
    tp_size: int = 1  # --ds_tensor_parallel_size: each rank holds 1/tp of every decoder matrix
    ring_size: int = 1  # --ring_attn_size: each rank holds 1/ring of a packed row's tokens
    train_tokens: int | None = None  # a training micro-batch's token budget (--use_dynamic_batch)
    score_tokens: int | None = None  # a scoring micro-batch's token budget (--use_dynamic_batch)


@dataclass
class MemoryPlan:
    """Bytes per component in each phase (``phases[name][component]``) against ``usable`` bytes, and
    what the run keeps in host memory (``host``) against ``host_capacity`` (None: not checked)."""

    phases: dict[str, dict[str, float]]
    capacity: float
    usable: float
    kv_cache: float
    kv_needed: float
    host: dict[str, float] = field(default_factory=dict)
    host_capacity: float | None = None

    def total(self, phase: str) -> float:
        return sum(self.phases[phase].values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.total)

    @property
    def peak(self) -> float:
        return self.total(self.peak_phase)

    @property
    def host_total(self) -> float:
        return sum(self.host.values())

    @property
    def fits_device(self) -> bool:
        return self.peak <= self.usable

    @property
    def fits_host(self) -> bool:
        return self.host_capacity is None or self.host_total <= HOST_FRACTION * self.host_capacity

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host

    def breakdown(self, phase: str | None = None) -> str:
        """``"fp32 weights 28.4 GiB + ... = 145.9 GiB"`` for ``phase`` (the peak one by default); parts
        under 1% of the total are left out."""
        phase = phase or self.peak_phase
        total = self.total(phase)
        parts = [f"{name} {size(b)}" for name, b in self.phases[phase].items() if b >= 0.01 * total]
        return f"{' + '.join(parts)} = {size(total)}"


def gib(n: float) -> float:
    return n / GIB


def size(n: float) -> str:
    """``"28.4 GiB"``, ``"3.1 MiB"``: bytes in the largest binary unit they fill."""
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _shard(nbytes: float, sharded: bool, dp_size: int) -> float:
    return nbytes / dp_size if sharded else nbytes


def master_name(s: MemorySettings) -> str:
    """``"fp32"`` or ``"bf16"``: the ``--master_dtype`` of ``s``."""
    return "fp32" if s.master_bytes == 4 else "bf16"


def lora_base_bytes(shape: ModelShape, s: MemorySettings) -> float:
    """A LoRA run's frozen base: the input embedding in the master dtype, every linear weight (the LM head
    included, unless tied to the embedding) in the narrower of the master and compute dtypes
    (``tidal.models.loading.store_frozen_linears``); 4-bit: half a byte each. Norms count as linears
    (a few thousand parameters a layer)."""
    if s.load_in_4bit:
        return 0.5 * shape.params
    embedding = shape.vocab * shape.hidden
    return embedding * s.master_bytes + (shape.params - embedding) * min(s.master_bytes, s.compute_bytes)


def trainer_state(shape: ModelShape, s: MemorySettings) -> dict[str, float]:
    """A trained model's weights, gradients and AdamW moments on the device (none with --adam_offload), in
    ``--master_dtype``. ``--zero_stage`` 3 shards the weights, 1 and 2 the gradients and moments."""
    if s.adam_offload:
        return {}
    m, dtype = s.master_bytes, master_name(s)
    trained = shape.lora_params(s.lora_rank) if s.lora_rank else shape.params
    weights = (lora_base_bytes(shape, s) if s.lora_rank else m * shape.params) / s.tp_size
    trained /= s.tp_size
    state = {
        f"{dtype} weights" if not s.lora_rank else "base weights": _shard(
            weights, s.zero_stage == 3, s.dp_size
        ),
        f"{dtype} grads": _shard(m * trained, s.zero_stage >= 2, s.dp_size),
        "AdamW states": _shard(2 * m * trained, s.zero_stage >= 1, s.dp_size),
    }
    if s.lora_rank:
        state["LoRA weights"] = m * trained
    return state


def compute_copy(shape: ModelShape, s: MemorySettings) -> float:
    """The compute-dtype copy of the weights a forward and backward hold: autocast's cache of every matmul
    weight (one process), or FSDP2's gathered parameters (one block at a time with --zero_stage 3)."""
    if s.compute_bytes >= 4 or s.load_in_4bit:
        return 0.0
    fsdp = s.dp_size > 1 or s.adam_offload
    if not fsdp and (s.lora_rank or s.master_bytes <= s.compute_bytes):
        return 0.0  # the weights are stored in the compute dtype already: autocast casts (caches) nothing
    whole = s.compute_bytes * shape.compute_params
    whole /= s.tp_size
    if fsdp and s.zero_stage == 3:
        return 2 * whole / shape.layers  # this block's and the prefetched next one's
    return whole


def activations(shape: ModelShape, s: MemorySettings, tokens: int, grad: bool) -> float:
    """Saved activations of ``tokens`` tokens: every tensor a decoder layer keeps for backward (bf16), or
    with checkpointing only each layer's float32 input plus one layer recomputed; without grad one layer."""
    h, kv, i = shape.hidden, shape.kv_heads * shape.head_dim, shape.intermediate
    q = shape.heads * shape.head_dim
    # norms' outputs, q/k/v, attention output, o_proj input, residuals (6h + q + 2kv) and the MLP's
    # gate, up, activation, product and down input (5i), in the compute dtype; float32 residual stream
    per_layer = tokens * (s.compute_bytes * (4 * h + 2 * q + 2 * kv + 5 * i) + 4 * h)
    if not grad:  # only the tensors alive at once: the MLP's gate, up and product, and the residual
        return tokens * (s.compute_bytes * (2 * h + 3 * i) + 8 * h)
    if s.gradient_checkpointing:
        return tokens * 4 * h * shape.layers + per_layer
    return per_layer * shape.layers


def logits(shape: ModelShape, tokens: int, grad: bool) -> float:
    """The LM head's float32 logits for its chunk of tokens, with their softmax (and its gradient)."""
    rows = min(tokens, LM_HEAD_CHUNK) if shape.chunkable_head else tokens
    return rows * shape.vocab * 4 * (3 if grad else 2)


def kv_cache(shape: ModelShape, s: MemorySettings, free_at_start: float) -> tuple[float, float]:
    """(the engine's KV cache, what its sequences could fill): the fraction of the memory free when it
    starts, at most ``max_num_seqs`` sequences of ``total_len`` tokens (``LLMEngine._kv_blocks``)."""
    blocks = math.ceil(s.total_len / KV_BLOCK)
    per_token = shape.kv_bytes_per_token  # bf16; FP8: one byte an element and 4 a row (runner/kv_cache.py)
    if s.fp8_kv_cache:
        per_token = 2 * shape.layers * shape.kv_heads * (shape.head_dim + 4)
    needed = s.max_num_seqs * blocks * KV_BLOCK * per_token
    return min(needed, max(free_at_start, 0) * s.vllm_gpu_memory_utilization), needed


def engine_weights(shape: ModelShape, s: MemorySettings) -> dict[str, float]:
    """The colocated engine's weights: bf16; with FP8 rollouts a byte for every weight but the embeddings
    and the LM head, which stay bf16 (norms and routers too: a few thousand weights a layer, and the
    float32 scales, a few MB at 7B, are not counted). Qwen2.5-7B: 8.706 GB planned, 8.712 measured
    (bench/fp8_rollout.py ``weights_gb``)."""
    if not s.fp8_weights:
        return {"engine bf16 weights": 2 * shape.params}
    kept = shape.vocab * shape.hidden * (1 if shape.tied_embeddings else 2)  # bf16: a second byte each
    return {"engine FP8 weights": shape.params + kept}


def host_state(shape: ModelShape, s: MemorySettings) -> dict[str, float]:
    """What the trained and frozen models of this host's ranks keep in host memory: the training state
    with --adam_offload (pinned), the resting state (weights, moments) while the engine generates with
    --deepspeed_enable_sleep, the reference with --ref_reward_offload."""
    on_device = dataclasses.replace(s, adam_offload=False)
    models = (1 + s.critic) * s.ranks_per_host
    host = {}
    if s.adam_offload:
        host = {f"host {k}": v * models for k, v in trainer_state(shape, on_device).items()}
    elif s.deepspeed_enable_sleep:
        resting = {k: v for k, v in trainer_state(shape, on_device).items() if "grads" not in k}
        host = {f"host {k} (asleep)": v * models for k, v in resting.items()}
    if s.reference and s.ref_offload:
        host["host reference"] = s.master_bytes * shape.params * s.ranks_per_host
    return host


def plan_memory(
    shape: ModelShape, s: MemorySettings, capacity: float, host_capacity: float | None = None
) -> MemoryPlan:
    """Bytes per component and phase on one device of ``capacity`` bytes, and in a host of
    ``host_capacity`` bytes (None: not checked; see the module docstring)."""
    usable = capacity - min(RESERVED, RESERVED_FRACTION * capacity)
    policy = trainer_state(shape, s)
    critic = {f"critic {k}": v for k, v in trainer_state(shape, s).items()} if s.critic else {}
    resident = dict(policy) | critic  # what the trained models keep between steps
    resting = {k: v for k, v in resident.items() if "grads" not in k}  # grads are freed after each step
    engine = engine_weights(shape, s) if s.engine_on_device else {}
    # The reference loads like the policy (tidal.models.frozen.frozen_copy_config keeps --master_dtype).
    reference = {f"reference {master_name(s)} weights": s.master_bytes * shape.params} if s.reference else {}
    parked_ref = {} if s.ref_offload else reference
    # The engine starts after the policy, critic and reference loaded (tidal.trainers.ppo.entry.build_parts)
    # and before any optimizer step: their weights are on the device, no moments yet. What mem_get_info
    # then reports free is the device less those (the reserve is not in use yet).
    weights = sum(v for k, v in resident.items() if "weights" in k)
    at_start = weights + sum(engine.values()) + sum(parked_ref.values())
    kv, kv_needed = kv_cache(shape, s, capacity - at_start) if s.engine_on_device else (0.0, 0.0)
    kv_part = {"KV cache": kv}
    kv_awake = {} if s.vllm_enable_sleep else kv_part  # --vllm_enable_sleep frees it while training
    asleep = s.deepspeed_enable_sleep  # the trainer's weights and moments wait in host memory
    score_tokens = (s.score_tokens or s.micro_rollout_batch_size * s.total_len) // s.ring_size
    train_tokens = (s.train_tokens or s.micro_train_batch_size * s.total_len) // s.ring_size
    phases = {
        "generate": ({} if asleep else resting) | parked_ref | engine | kv_part,
        "make experience": resting | reference | engine | kv_awake | {
            "compute copy": compute_copy(shape, s),
            "activations": activations(shape, s, score_tokens, grad=False),
            "logits": logits(shape, score_tokens, grad=False),
        },
        "train": resident | parked_ref | engine | kv_awake | {
            "compute copy": compute_copy(shape, s),
            "activations": activations(shape, s, train_tokens, grad=True),
            "logits": logits(shape, train_tokens, grad=True),
        },
    }  # fmt: skip
    return MemoryPlan(phases, capacity, usable, kv, kv_needed, host_state(shape, s), host_capacity)


# Flags that free memory at the peak, cheapest first: (the flag as the user types it, the settings it
# changes). --deepspeed_enable_sleep is not one: it frees the trainer's memory only while the engine
# generates, whose KV cache was sized when the engine started, so it never lowers the peak. The first four
# keep the numerics; --master_dtype bf16 changes them (updates below bf16's resolution are lost), and
# --lora_rank changes the method, so they come last, in that order.
FIXES = (
    ("--gradient_checkpointing", {"gradient_checkpointing": True}),
    ("--vllm_enable_sleep", {"vllm_enable_sleep": True}),
    ("--ref_reward_offload", {"ref_offload": True}),
    ("--adam_offload", {"adam_offload": True}),
    ("--master_dtype bf16", {"master_bytes": 2}),
    (f"--lora_rank {LORA_RANK_ADVICE}", {"lora_rank": LORA_RANK_ADVICE}),
)


def _applies(flag: str, s: MemorySettings) -> bool:
    """A fix is worth naming only where it changes something and the run can take it."""
    if flag == "--vllm_enable_sleep" and not s.engine_on_device:
        return False
    if flag == "--ref_reward_offload" and not s.reference:
        return False
    if flag == "--master_dtype bf16" and s.compute_bytes != 2:  # it needs bf16 compute
        return False
    return not (flag.startswith("--lora_rank") and s.lora_rank)


def fix_for(
    shape: ModelShape, s: MemorySettings, capacity: float, host_capacity: float | None = None
) -> list[str]:
    """The fewest flags (cheapest first) that make the run fit device and host: one flag if any single one
    does, else the cheapest ones added in order until it fits; [] when it fits already or nothing helps."""

    def fits(settings: MemorySettings) -> bool:
        return plan_memory(shape, settings, capacity, host_capacity).fits

    if fits(s):
        return []
    candidates = [
        (flag, change)
        for flag, change in FIXES
        if _applies(flag, s) and any(getattr(s, k) != v for k, v in change.items())
    ]
    for flag, change in candidates:
        if fits(dataclasses.replace(s, **change)):
            return [flag]
    chosen, current = [], s
    for flag, change in candidates:
        chosen.append(flag)
        current = dataclasses.replace(current, **change)
        if fits(current):
            return chosen
    return []
