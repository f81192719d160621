"""Paged decode attention over an FP8 KV cache: ``fp8_decode.cu`` compiled at run time by NVRTC.

``triton_attention.paged_decode_attention`` sends an FP8 cache's decode steps here when ``variant_for`` says
the kernel covers the call (no sliding window, no sinks, head_dim 64 or 128, up to 8 query heads a kv head,
pages of a multiple of 16 slots, bf16/fp16 queries, a GPU with e4m3 conversions: compute capability 8.9 or
newer) and the kernel compiles; anything else keeps the Triton kernel. The source file says why a
hand-written kernel, and how its bytes reach the tensor cores.

Compiled by NVRTC (``nvrtc.py``: torch's ``_compile_kernel``, or NVRTC itself where there is no CUDA
toolkit), once per ``Variant``. When NVRTC is missing or refuses the source, the engine warns once with
the reason and keeps the Triton kernel for the rest of the process.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from tidal.rollout.kernels import nvrtc

SOURCE = Path(__file__).with_name("fp8_decode.cu")
ROPE_SOURCE = Path(__file__).with_name("fp8_decode_rope.cu")  # the ROPE build's RoPE + store, appended
CHUNK = 16  # tokens an MMA tile; pages must hold a whole number of them
MAX_GROUP = 8  # query heads a kv head: the MMA's 8 columns
# The launch (read at each call; bench/decode_attention.py --cuda_settings times others): 4 warps a CTA, a
# 2-stage pipeline, registers capped for 4 CTAs an SM, a sequence's kv heads side by side. H200, B=256,
# ms a call at the 7B shape: 0.0392 against 0.0407-0.0462 for 2 or 8 warps, 3 or 4 stages, other caps.
WARPS = 4
STAGES = 2
MIN_BLOCKS = 4
HEADS_FIRST = 1
LOG2_E = 1.4426950408889634  # the kernel's softmax runs in base 2


@dataclass(frozen=True)
class Variant:
    """The compile-time constants of one build of the kernel."""

    head_dim: int = 128
    group: int = 7
    block_size: int = 16
    warps: int = WARPS
    fp16: int = 0  # 1: fp16 queries and output; 0: bf16
    int64: int = 0  # 1: int64 block tables and context lengths; 0: int32
    stages: int = STAGES
    min_blocks: int = MIN_BLOCKS
    heads_first: int = HEADS_FIRST
    rope: int = 0  # 1: q is the packed projection; the kernel does rope_store_kv's work (one split only)

    def defines(self) -> str:
        values = {
            "HEAD_DIM": self.head_dim,
            "GROUP": self.group,
            "BLOCK_SIZE": self.block_size,
            "WARPS": self.warps,
            "Q_FP16": self.fp16,
            "BT_INT64": self.int64,
            "STAGES": self.stages,
            "MIN_BLOCKS": self.min_blocks,
            "HEADS_FIRST": self.heads_first,
            "ROPE": self.rope,
            "KSTRIDE": self.kstride,
            "VSTRIDE": self.vstride,
            "STAGE_BYTES": self.stage_bytes,
        }
        return "".join(f"#define {k} {v}\n" for k, v in values.items())

    # A pipeline stage in shared memory: 16 key rows, 16 value rows, 32 float32 scales. A warp's 16-byte
    # reads must hit distinct banks: heads of 128 swizzle their rows (fp8_decode.cu's KSWZ / VSWZ), unpadded;
    # heads of 64 pad their value rows by 16 bytes (rows 2t and 2t + 2 land 32 bytes apart modulo 128), their
    # key rows g and g + 1 sharing 128 bytes already.
    @property
    def kstride(self) -> int:
        return self.head_dim

    @property
    def vstride(self) -> int:
        return self.head_dim if self.head_dim == 128 else self.head_dim + 16

    @property
    def stage_bytes(self) -> int:
        return 16 * self.kstride + 16 * self.vstride + 128

    def smem_bytes(self) -> int:
        """Dynamic shared memory a CTA takes: the warps' pipelines, or the merge's buffers if larger."""
        merge = 4 * (2 * 8 * self.warps + 8 * self.warps * self.head_dim)
        return max(self.warps * self.stages * self.stage_bytes, merge)


def kernel_source(variant: Variant) -> str:
    """The CUDA source of ``variant``: its constants, ``fp8_decode.cu``, then ``fp8_decode_rope.cu``."""
    return variant.defines() + SOURCE.read_text() + ROPE_SOURCE.read_text()


_KERNELS: dict[tuple[Variant, int], object] = {}
_BROKEN: list[str] = []  # the first compile failure's reason; non-empty: never try again


def variant_for(
    q: torch.Tensor, num_heads: int, layer_cache: torch.Tensor, block_tables: torch.Tensor, window, sinks
) -> Variant | None:
    """The build that covers this decode call (``num_heads`` query heads in q), or None: the Triton
    kernel takes it (see ``covers``)."""
    if _BROKEN or not q.is_cuda or window is not None or sinks is not None:
        return None
    if q.data_ptr() % 16 or q.stride(0) % 8 or q.stride(1) % 8:  # the kernel reads q 16 bytes at a time
        return None
    _, _, block_size, num_kv_heads, head_dim = layer_cache.shape
    dtypes = (q.dtype, layer_cache.dtype, block_tables.dtype)
    capability = torch.cuda.get_device_capability(q.device)
    if not covers(head_dim, num_heads, num_kv_heads, block_size, dtypes, capability):
        return None
    return Variant(
        head_dim=head_dim,
        group=num_heads // num_kv_heads,
        block_size=block_size,
        fp16=int(q.dtype == torch.float16),
        int64=int(block_tables.dtype == torch.int64),
        warps=WARPS,  # read at each call: bench/decode_attention.py times other settings
        stages=STAGES,
        min_blocks=MIN_BLOCKS,
        heads_first=HEADS_FIRST,
    )


def rope_fusable(rope, num_splits: int) -> bool:
    """Whether the ROPE build can take this call's RoPE and store: one context split (a split elsewhere
    would read the step's own key before its store), cos/sin rows the kernel reads 16 bytes at a time, and
    int64 slots."""
    cos, sin = rope.cos, rope.sin
    return (
        num_splits == 1
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cos.data_ptr() % 16 == 0
        and sin.data_ptr() % 16 == 0
        and rope.slot_mapping.dtype == torch.int64
        and rope.slot_mapping.is_contiguous()
    )


def covers(head_dim: int, num_heads: int, num_kv_heads: int, block_size: int, dtypes, capability) -> bool:
    """Whether the kernel handles these heads, pages, (query, cache, block table) dtypes and GPU: heads of
    64 or 128, up to ``MAX_GROUP`` query heads a kv head, pages of a multiple of ``CHUNK`` slots, bf16/fp16
    queries over an e4m3 cache, int32/int64 tables, and e4m3 conversions in hardware (sm_89 or newer)."""
    q_dtype, cache_dtype, table_dtype = dtypes
    return (
        cache_dtype == torch.float8_e4m3fn
        and q_dtype in (torch.bfloat16, torch.float16)
        and head_dim in (64, 128)
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and block_size % CHUNK == 0
        and table_dtype in (torch.int32, torch.int64)
        and tuple(capability) >= (8, 9)
    )


def compiled(variant: Variant, device: torch.device):
    """The kernel of ``variant`` on ``device``, compiled on first use; None if NVRTC fails (warned once)."""
    key = (variant, device.index or 0)
    if key not in _KERNELS and not _BROKEN:
        try:
            kernel = nvrtc.load_kernel(kernel_source(variant), "fp8_paged_decode", device)
            kernel.set_shared_memory_config(variant.smem_bytes())  # past 48 KB it must be raised
            _KERNELS[key] = kernel
        except Exception as exc:  # no libnvrtc, or the source refused
            _BROKEN.append(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}")
            warnings.warn(
                f"the CUDA decode kernel for FP8 KV caches did not compile ({_BROKEN[0]}); "
                "FP8-cache decode attention keeps the (slower) Triton kernel",
                stacklevel=2,
            )
    return _KERNELS.get(key)


def fp8_paged_decode(
    variant: Variant,
    kernel,
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    kv_scales: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    part: torch.Tensor,
    lse: torch.Tensor,
    num_splits: int,
    rope=None,
) -> None:
    """Decode attention of q [batch, heads, d] over the FP8 ``layer_cache`` [2, blocks, block_size,
    kv_heads, d] with ``kv_scales`` [2, blocks, block_size, kv_heads] into ``out`` [batch, heads, d] (one
    split) or ``part`` / ``lse`` (``triton_attention.split_buffers``; the caller merges them). ``variant``:
    ``variant_for``'s; ``kernel``: ``compiled``'s build of it. A ``rope`` build (``rope``:
    ``triton_attention.RopeInputs``, cos/sin contiguous, ``rope_fusable``) takes the packed projection
    [batch, heads + 2 kv_heads, d] as q, and rotates and stores the step's keys and values itself."""
    batch = q.shape[0]
    num_kv_heads = layer_cache.shape[3]
    assert context_lens.dtype == block_tables.dtype and block_tables.stride(1) == 1
    assert q.stride(-1) == 1 and layer_cache.is_contiguous() and kv_scales.is_contiguous()
    assert bool(variant.rope) == (rope is not None) and (rope is None or num_splits == 1)
    k, v = layer_cache[0], layer_cache[1]
    cos, sin, slots = (q, q, q) if rope is None else (rope.cos, rope.sin, rope.slot_mapping)
    kernel(
        grid=(num_kv_heads, batch, num_splits) if variant.heads_first else (batch, num_kv_heads, num_splits),
        block=(variant.warps * 32, 1, 1),
        shared_mem=variant.smem_bytes(),
        args=[
            q, k, v, kv_scales[0], kv_scales[1], block_tables, context_lens, out, part, lse,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), kv_scales.stride(1), kv_scales.stride(2),
            block_tables.stride(0), block_tables.shape[1], float(scale * LOG2_E), num_splits,
            cos, sin, cos.stride(0) if rope is not None else 0, slots,
        ],
    )  # fmt: skip
