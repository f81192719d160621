"""The CUDA decode kernel over an FP8 cache, what the CPU can check: the bit move that turns an e4m3 byte
into a bf16 (``fp8_decode.cu``'s ``e4m3_pair_to_bf16x2``) is exact for every byte, the value-scale shift
keeps the products in range, which calls the kernel covers, that its source carries no constant the
loader does not define, and that its shared-memory layout (swizzled rows) holds every byte once and reads
without bank conflicts. The kernel itself runs in test_cuda_fp8_decode_gpu.py."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from tidal.rollout.kernels import cuda_fp8_decode as cfd

FP8, BF16, FP16, I32, I64 = torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.int32, torch.int64


def _bf16_bits_of_byte_pairs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The kernel's move, in int64 arithmetic: a 32-bit word with byte 1 = a, byte 3 = b (bytes 0 and 2
    arbitrary: here 0xA5), then sign to bit 15 / 31 and exponent + mantissa shifted right by 4."""
    x = (a << 8) | (b << 24) | 0xA5 | (0xA5 << 16)
    return (x & 0x80008000) | ((x >> 4) & 0x07F007F0)


def test_every_e4m3_byte_becomes_its_value_times_2_to_the_minus_120_in_bf16():
    byte = torch.arange(256, dtype=torch.int64)
    finite = (byte & 0x7F) != 0x7F  # 0x7F / 0xFF are e4m3's NaNs: the cache never holds them
    words = _bf16_bits_of_byte_pairs(byte, byte.flip(0))
    lo = (words & 0xFFFF).to(torch.int32).to(torch.int16).view(BF16)
    hi = ((words >> 16) & 0xFFFF).to(torch.int32).to(torch.int16).view(BF16)
    value = byte.to(torch.uint8).view(FP8).double()
    assert torch.equal(lo.double()[finite], value[finite] * 2.0**-120)
    assert torch.equal(hi.double()[finite.flip(0)], value.flip(0)[finite.flip(0)] * 2.0**-120)
    assert torch.isfinite(lo.double()).all()  # NaN bytes (never-written slots) stay finite: 0 x them is 0
    assert lo[0].item() == 0.0 and lo[1].item() > 0  # zero and the smallest subnormal survive


@pytest.mark.parametrize("amax", [1e-20, 1e-6, 1.0, 1e4, 1e10])
def test_the_value_path_keeps_rows_of_any_size(amax):
    """The kernel's probabilities x values, emulated: values as their e4m3 bytes moved into bf16 (x 2^-120),
    probability x value scale x 2^100 rounded to bf16, products summed in float32, the sum x 2^20. For
    value rows from 1e-20 to 1e10 this stays within bf16 rounding of the float64 sum (no overflow in bf16,
    no float32 subnormals)."""
    from tidal.rollout.runner import kv_cache

    gen = torch.Generator().manual_seed(0)
    rows = (torch.randn(64, 1, 128, generator=gen) * amax).to(BF16)
    bytes_, scales = kv_cache.quantize_heads(rows)
    values, scales = bytes_.view(64, 128).double(), scales.view(64).double()
    p = torch.rand(64, generator=gen, dtype=torch.float64)
    in_bf16 = (values * 2.0**-120).to(BF16)
    assert torch.equal(in_bf16.double(), values * 2.0**-120)  # exact
    weights = (p * scales * 2.0**100).float().to(BF16)
    assert torch.isfinite(weights.float()).all()
    out = (weights.float()[:, None] * in_bf16.float()).sum(0) * 2.0**20
    reference = (p * scales)[:, None].mul(values).sum(0)
    assert ((out.double() - reference).norm() / reference.norm()).item() < 1e-2


@pytest.mark.parametrize(
    "head_dim, heads, kv_heads, block, dtypes, capability, expected",
    [
        (128, 28, 4, 16, (BF16, FP8, I32), (9, 0), True),  # Qwen2.5-7B on an H100/H200
        (64, 14, 2, 32, (FP16, FP8, I64), (8, 9), True),  # 0.5B, fp16, larger pages, an L40
        (128, 32, 8, 16, (BF16, FP8, I32), (10, 0), True),
        (128, 28, 4, 16, (BF16, FP8, I32), (8, 0), False),  # A100: no e4m3 conversions
        (128, 28, 4, 16, (BF16, BF16, I32), (9, 0), False),  # a bf16 cache
        (128, 28, 4, 16, (torch.float32, FP8, I32), (9, 0), False),  # float32 queries
        (256, 16, 8, 16, (BF16, FP8, I32), (9, 0), False),  # heads of 256 (Gemma)
        (128, 64, 4, 16, (BF16, FP8, I32), (9, 0), False),  # 16 query heads a kv head
        (128, 28, 4, 8, (BF16, FP8, I32), (9, 0), False),  # pages of 8 slots
    ],
)
def test_covers_what_the_kernel_handles(head_dim, heads, kv_heads, block, dtypes, capability, expected):
    assert cfd.covers(head_dim, heads, kv_heads, block, dtypes, capability) is expected


def test_cpu_calls_keep_the_triton_or_torch_paths():
    q = torch.zeros(2, 28, 128, dtype=BF16)
    cache = torch.zeros(2, 4, 16, 4, 128, dtype=FP8)
    tables = torch.zeros(2, 2, dtype=I32)
    assert cfd.variant_for(q, 28, cache, tables, None, None) is None


def test_the_source_uses_only_constants_the_loader_defines():
    source = re.sub(r"//[^\n]*", "", cfd.kernel_source(cfd.Variant()))  # code, not comments
    defined = set(re.findall(r"#define (\w+)", source))
    defined |= set(re.findall(r"constexpr \w+ (\w+)", source))
    used = set(re.findall(r"#if !?(\w+)", source)) | set(re.findall(r"\b([A-Z][A-Z0-9_]{2,})\b", source))
    assert used <= defined | {"NEG_INF"}, used - defined


def _nvrtc_or_skip():
    from tidal.rollout.kernels import nvrtc

    try:
        return nvrtc.nvrtc_library("13")
    except OSError as err:
        pytest.skip(f"no NVRTC here: {err}")


@pytest.mark.parametrize("head_dim, group", [(128, 7), (64, 8), (128, 1)])
@pytest.mark.parametrize("fp16, int64", [(0, 0), (1, 1)])
@pytest.mark.parametrize("rope", [0, 1])
def test_every_build_compiles_for_hopper(head_dim, group, fp16, int64, rope):
    """The source compiles for sm_90 through NVRTC without a GPU or a CUDA toolkit (where pip's
    nvidia-cuda-nvrtc is installed; skipped elsewhere, as on CI), with and without its RoPE + store."""
    from tidal.rollout.kernels import nvrtc

    lib = _nvrtc_or_skip()
    variant = cfd.Variant(head_dim=head_dim, group=group, fp16=fp16, int64=int64, block_size=32, rope=rope)
    binary = nvrtc.cubin(cfd.kernel_source(variant), "fp8_paged_decode", "90", lib)
    assert binary[:4] == b"\x7fELF" and b"fp8_paged_decode" in binary


def test_a_refused_source_raises_with_nvrtcs_log():
    from tidal.rollout.kernels import nvrtc

    lib = _nvrtc_or_skip()
    with pytest.raises(RuntimeError, match=r"NVRTC refused broken\.cu:[\s\S]*undefined"):
        nvrtc.cubin('extern "C" __global__ void broken() { no_such_thing(); }', "broken", "90", lib)


def test_the_rope_build_takes_one_split_contiguous_angles_and_int64_slots():
    """A split context would read the step's key before its store; the kernel reads cos/sin rows 16 bytes at
    a time and the slots as int64: anything else keeps ``rope_store_kv``'s launch before the plain build."""
    cos = torch.zeros(4, 128, dtype=BF16)
    slots = torch.zeros(4, dtype=torch.int64)
    rope = SimpleNamespace(cos=cos, sin=cos.clone(), slot_mapping=slots)
    assert cfd.rope_fusable(rope, 1)
    assert not cfd.rope_fusable(rope, 2)
    assert not cfd.rope_fusable(SimpleNamespace(cos=cos[:, ::2], sin=cos, slot_mapping=slots), 1)
    assert not cfd.rope_fusable(
        SimpleNamespace(cos=cos.view(-1)[1:].view(1, -1), sin=cos, slot_mapping=slots), 1
    )
    assert not cfd.rope_fusable(SimpleNamespace(cos=cos, sin=cos, slot_mapping=slots.int()), 1)


def _swizzles(head_dim: int):
    """``fp8_decode.cu``'s KSWZ and VSWZ for ``head_dim``, read from the source (C and Python agree on
    their expressions: parentheses, &, >>, <<)."""
    source = cfd.SOURCE.read_text()
    wide, narrow = re.search(r"#if HEAD_DIM == 128\n(.*?)#else\n(.*?)#endif", source, re.S).groups()
    branch = wide if head_dim == 128 else narrow
    found = dict(re.findall(r"#define ([KV]SWZ)\(r\) (.+)", branch))
    return tuple(eval(f"lambda r: {found[name]}") for name in ("KSWZ", "VSWZ"))  # noqa: S307


@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_stage_holds_every_byte_once_and_a_warps_reads_hit_distinct_banks(head_dim):
    """The copies' layout (``copy_chunk``) puts each 16-byte piece of the 16 key and 16 value rows at its
    own place inside the rows' bytes, where ``read_chunk`` looks for it; and each shared-memory read phase
    (8 lanes of a 16-byte read, 16 of an 8-byte one: 128 bytes) touches 128 distinct bytes modulo 128, i.e.
    no bank twice. A wrong swizzle fails on the GPU as wrong outputs or, worse, only as a slower kernel."""
    variant = cfd.Variant(head_dim=head_dim)
    kswz, vswz = _swizzles(head_dim)
    kstride, vstride = variant.kstride, variant.vstride
    kb, vb = head_dim // 4, head_dim // 8  # bytes a thread reads from each key / value token
    written = {}
    for r in range(16):
        for col in range(0, head_dim, 16):
            written[("k", r, col)] = r * kstride + (col ^ kswz(r))
            written[("v", r, col)] = 16 * kstride + r * vstride + (col ^ vswz(r))
    offsets = sorted(written.values())
    assert len(set(offsets)) == len(offsets) and offsets[-1] + 16 <= 16 * (kstride + vstride)
    assert all(o % 16 == 0 for o in offsets)

    def phases(addresses: list[int], width: int) -> None:  # lane order; 128 bytes a phase
        per_phase = 128 // width
        for p in range(0, 32, per_phase):
            banks = [a % 128 // width for a in addresses[p : p + per_phase]]
            assert sorted(banks) == list(range(per_phase)), (p, banks)

    lanes = [(lane // 4, lane % 4) for lane in range(32)]
    for i in range(kb // 16):  # key reads: 16 bytes at t * 16 + 64 i of rows g and g + 8
        for row_shift in (0, 8):
            cols = [(t * 16 + 64 * i) ^ kswz(g) for g, t in lanes]
            for (g, t), col in zip(lanes, cols, strict=True):  # where the copies put that piece
                assert written[("k", g + row_shift, t * 16 + 64 * i)] == (g + row_shift) * kstride + col
            phases([(g + row_shift) * kstride + col for (g, _), col in zip(lanes, cols, strict=True)], 16)
    for offset in (0, 1, 8, 9):
        # value reads: vb bytes at g * vb of tokens 2t + offset, swizzled as row 2t (read_chunk)
        addresses = [16 * kstride + (2 * t + offset) * vstride + ((g * vb) ^ vswz(2 * t)) for g, t in lanes]
        for (g, t), address in zip(lanes, addresses, strict=True):
            piece = g * vb // 16 * 16
            assert address - (g * vb) % 16 == written[("v", 2 * t + offset, piece)], (offset, g, t)
        phases(addresses, min(vb, 16))


def test_the_default_launch_keeps_four_ctas_an_sm_at_7b():
    """The launch's register cap is for 4 CTAs an SM (``MIN_BLOCKS``); their shared memory must fit too (an
    H100/H200 SM has 228 KB, 1 KB of it reserved a CTA), or the GPU runs 3 and the pipeline starves."""
    variant = cfd.Variant(head_dim=128, group=7)
    assert cfd.MIN_BLOCKS == 4 and variant.stage_bytes == 16 * 128 * 2 + 128
    assert cfd.MIN_BLOCKS * (variant.smem_bytes() + 1024) <= 228 * 1024
