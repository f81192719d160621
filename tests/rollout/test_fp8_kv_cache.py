"""The FP8 KV cache (``EngineConfig.kv_cache_dtype = "fp8"``, ``tidal/rollout/runner/kv_cache.py``) on the CPU:
the per-row quantization's error bounds, stores and gathers, block copies, the torch attention paths over an
FP8 cache, an engine whose log-probs are those of a transformers model reading FP8-rounded keys and values,
and the settings it refuses. The Triton kernels' FP8 paths run here under Triton's interpreter (skipped in
CI, which has no triton); ``test_fp8_kv_gpu.py`` runs them compiled, at realistic shapes."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tests.rollout.reference import PROMPTS, cpu_config, greedy
from tests.rollout.triton_interpreter import interpreted
from tidal.config.args import ConfigError
from tidal.rollout import EngineConfig, LLMEngine, SamplingParams
from tidal.rollout.engine.config import family_problem
from tidal.rollout.engine.hf_engine import fallback_problem
from tidal.rollout.runner import attention, kv_cache
from tidal.rollout.runner.attention import AttentionMetadata


def _dequantized(x: torch.Tensor) -> torch.Tensor:
    q, scales = kv_cache.quantize_heads(x)
    return (q.float() * scales[..., None]).to(x.dtype)


# ------------------------------------------------------------------------------------ quantization
def test_each_row_has_its_own_scale_and_the_e4m3_error_bound():
    """Rows of very different sizes (a key bias of 300, values of 1e-3): each row's largest element maps to
    +-448 exactly, every element is within e4m3's half-ulp of its row (relative 2^-4 in the normal range,
    2^-10 of the row's scale below it), and an all-zero row stays zero with scale 1."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, 64, generator=gen)
    x[0, 0] *= 1e-3
    x[1, 2, 5] = 300.0  # one outlier: its row's other elements keep their own relative precision
    x[2, 1] = 0.0
    q, scales = kv_cache.quantize_heads(x)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (6, 3) and scales.dtype == torch.float32
    back = q.float() * scales[..., None]
    bound = 2**-4 * x.abs() + 2**-10 * scales[..., None]
    assert ((back - x).abs() <= bound).all()
    nonzero = x.abs().amax(-1) > 0
    assert (q.float().abs().amax(-1)[nonzero] == 448).all()
    assert scales[2, 1] == 1 and (q[2, 1].float() == 0).all()
    # A tensor-wide scale (vLLM's uncalibrated 1.0) puts the small row in e4m3's subnormals: 10x the error.
    tensor_wide = x[0, 0].to(torch.float8_e4m3fn).float()
    assert (back[0, 0] - x[0, 0]).abs().max() * 4 < (tensor_wide - x[0, 0]).abs().max()


def _cache(blocks=8, block_size=4, heads=2, dim=16, dtype=torch.float32):
    args = type("Args", (), {"kv_layers": 1, "local_kv_heads": heads, "head_dim": dim})()
    return kv_cache.allocate(args, blocks, block_size, dtype, torch.device("cpu"), fp8=True), args


def test_store_gather_and_copy_keep_each_row_with_its_scale():
    (cache, scales), _ = _cache()
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(5, 2, 16, generator=gen) * 10, torch.randn(5, 2, 16, generator=gen) * 0.01
    slots = torch.tensor([3, 4, 9, 17, 30])
    kv_cache.store(cache[0], scales[0], k, v, slots)
    tables = torch.arange(8).view(1, 8)  # one row holding every block, in order
    kv = kv_cache.gather(cache[0], scales[0], tables, torch.float32)  # [2, 1, 32 slots, heads, d]
    assert torch.equal(kv[0, 0, slots], _dequantized(k)) and torch.equal(kv[1, 0, slots], _dequantized(v))
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert (kv[:, 0, untouched] == 0).all()
    # Block 0 (slot 3) copied over block 5: values and scales alike.
    kv_cache.copy_blocks(cache, scales, torch.tensor([0]), torch.tensor([5]))
    again = kv_cache.gather(cache[0], scales[0], tables, torch.float32)
    assert torch.equal(again[:, 0, 23], again[:, 0, 3]) and torch.equal(again[0, 0, 23], _dequantized(k)[0])


def test_bytes_per_block_are_an_element_a_byte_plus_a_scale_a_row():
    args = type("Args", (), {"kv_layers": 28, "local_kv_heads": 4, "head_dim": 128})()
    bf16 = kv_cache.bytes_per_block(args, 16, torch.bfloat16)
    fp8 = kv_cache.bytes_per_block(args, 16, torch.bfloat16, fp8=True)
    assert bf16 == 28 * 2 * 16 * 4 * 128 * 2 and fp8 == 28 * 2 * 16 * 4 * (128 + 4)
    assert round(bf16 / fp8, 2) == 1.94


def test_torch_paths_read_the_fp8_cache_as_its_dequantized_values():
    """Decode and prefill-with-context over an FP8 cache equal the same paths over a model-dtype cache that
    holds the dequantized values, bit for bit."""
    (cache, scales), _ = _cache(heads=2, dim=16)
    gen = torch.Generator().manual_seed(2)
    kv_cache.store(
        cache[0], scales[0], *(torch.randn(32, 2, 16, generator=gen) for _ in range(2)), torch.arange(32)
    )
    tables = torch.tensor([[3, 1, 0, 7], [2, 6, 5, 4]])
    plain = kv_cache.gather(cache[0], scales[0], torch.arange(8)[None], torch.float32)[:, 0]
    plain = plain.reshape(2, 8, 4, 2, 16)  # the dequantized cache, in the model dtype
    q = torch.randn(2, 6, 16, generator=gen)
    ctx = torch.tensor([13, 16])
    decode = AttentionMetadata(
        is_prefill=False, slot_mapping=None, kv_cache=cache, block_tables=tables, context_lens=ctx
    )
    fp8 = attention.torch_decode_attention(q, cache[0], decode, None, 0.25, scales[0])
    assert torch.equal(fp8, attention.torch_decode_attention(q, plain, decode, None, 0.25))
    valid = torch.tensor([[True, True, True], [True, False, False]])
    context = AttentionMetadata(
        is_prefill=True, slot_mapping=None, kv_cache=cache, pad_index=torch.tensor([[0, 1, 2], [3, 3, 3]]),
        pad_valid=valid, block_tables=tables, context_lens=ctx, query_starts=torch.tensor([10, 15]),
    )  # fmt: skip
    q4 = torch.randn(4, 6, 16, generator=gen)
    fp8 = attention.torch_context_prefill_attention(q4, cache[0], context, None, 0.25, scales[0])
    assert torch.equal(fp8, attention.torch_context_prefill_attention(q4, plain, context, None, 0.25))


# ------------------------------------------------------------------------------------------ engine
FIRST_DECODE = {"position": 0}  # the query position from which the reference reads rounded keys/values


def _decode_reads_rounded_kv(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention as the engine attends with an FP8 cache: queries before
    ``FIRST_DECODE["position"]`` (the prompt's, one prefill) attend the keys and values as computed; later
    ones (decode steps) attend every key and value rounded through the cache's quantization."""
    plain, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    key, value = (_dequantized(x.transpose(1, 2)).transpose(1, 2) for x in (key, value))
    rounded, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    start = FIRST_DECODE["position"]  # outputs are [batch, positions, heads, d]
    return torch.cat([plain[:, :start], rounded[:, start:]], dim=1), None


AttentionInterface.register("tidal_fp8_kv", _decode_reads_rounded_kv)


@torch.no_grad()
def _logits(model, ids: list[int], start: int) -> torch.Tensor:
    """The logits that score ``ids[start:]``, the first generated token's from the prompt's last position
    (the prefill), each later one's from the token before it (a decode step)."""
    FIRST_DECODE["position"] = start
    return model(torch.tensor([ids])).logits[0, start - 1 : -1].float()


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_5_text"])
def test_engine_logprobs_are_those_of_a_model_reading_fp8_rounded_keys_and_values(family, tiny_model):
    """The prefill attends the prompt's keys and values as computed (and stores them rounded); every decode
    step reads all keys and values back from the FP8 cache: the engine's greedy tokens and log-probs are
    those of transformers' model attending that way (``_decode_reads_rounded_kv``). The model-dtype engine's
    log-probs are farther from that reference than the tolerance."""
    path = tiny_model(family)
    engine = LLMEngine(path, cpu_config(kv_cache_dtype="fp8"))
    assert engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    reference = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="tidal_fp8_kv"
    ).eval()
    outs = engine.generate(PROMPTS, greedy(10))
    plain = LLMEngine(path, cpu_config()).generate(PROMPTS, greedy(10))
    gaps, plain_gaps = [], []
    for prompt, out, base in zip(PROMPTS, outs, plain, strict=True):
        tokens = out.outputs[0].token_ids
        logits = _logits(reference, prompt + tokens, len(prompt))
        assert logits.argmax(-1).tolist() == tokens
        want = logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
        gaps += [abs(a - b) for a, b in zip(out.outputs[0].logprobs, want, strict=True)]
        if base.outputs[0].token_ids == tokens:
            plain_gaps += [abs(a - b) for a, b in zip(base.outputs[0].logprobs, want, strict=True)]
    assert max(gaps) < 1e-4
    assert max(plain_gaps) > 1e-3  # the rounding shows, and the tolerance can tell


def test_samples_of_one_prompt_share_its_blocks_with_their_scales(tiny_model):
    """n = 3 greedy samples: the prompt's last (partial) block is copied to each sample, scales included,
    so all three decode the same tokens and log-probs (a copy without scales would read scale 1)."""
    engine = LLMEngine(tiny_model("qwen2"), cpu_config(kv_cache_dtype="fp8", block_size=4))
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True, n=3)
    (out,) = engine.generate([list(range(10, 17))], params)
    single = engine.generate([list(range(10, 17))], greedy(8))[0].outputs[0]
    for sample in out.outputs:  # 1e-5: a batch of three rows need not round as one row does
        assert sample.token_ids == single.token_ids
        assert max(abs(a - b) for a, b in zip(sample.logprobs, single.logprobs, strict=True)) < 1e-5


def test_the_fp8_cache_holds_more_tokens_in_the_same_budget(tiny_model):
    path = tiny_model("qwen2")
    small = dict(cpu_kv_cache_gb=0.001, max_model_len=4096)
    plain, fp8 = (LLMEngine(path, cpu_config(**small, kv_cache_dtype=d)) for d in ("auto", "fp8"))
    dim = plain.model.args.head_dim  # float32 is 4 bytes an element, FP8 1 plus a 4-byte scale a row
    assert fp8.num_kv_blocks == pytest.approx(plain.num_kv_blocks * 4 * dim / (dim + 4), rel=0.02)


def test_a_vision_language_model_reads_its_image_prompt_back_rounded(tmp_path):
    """Qwen2.5-VL with an image: the first token (the prefill's) has the model-dtype engine's log-prob, the
    later ones (decode steps reading the FP8 cache) move; the n = 2 samples of one image prompt share its
    blocks, scales included (the same tokens, greedy)."""
    from transformers import AutoModelForImageTextToText

    from tests.rollout.test_qwen2_5_vl import _image
    from tidal.data.vision import load_vision_processor
    from tidal.models import load_tokenizer
    from tidal.rollout.runner.multimodal import MultiModalInput
    from tidal.testing import build_tiny_vlm

    path = build_tiny_vlm(tmp_path / "vlm")
    tokenizer = load_tokenizer(str(path))
    processor = load_vision_processor(str(path), tokenizer).image_processor
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True, n=2)
    image = [MultiModalInput(images=[_image(3, (56, 56))])]
    outs = {}
    for kv in ("auto", "fp8"):
        hf = AutoModelForImageTextToText.from_pretrained(str(path)).eval()
        config = cpu_config(kv_cache_dtype=kv, max_model_len=256, block_size=4)
        engine = LLMEngine(model=hf, tokenizer=tokenizer, config=config, image_processor=processor)
        outs[kv] = engine.generate([ids], params, multi_modal=image)[0].outputs
    plain, fp8 = outs["auto"][0], outs["fp8"]
    assert fp8[0].token_ids == fp8[1].token_ids
    assert abs(fp8[0].logprobs[0] - plain.logprobs[0]) < 1e-5
    same = next(
        (i for i, (a, b) in enumerate(zip(plain.token_ids, fp8[0].token_ids, strict=True)) if a != b), 8
    )
    assert (
        max(abs(a - b) for a, b in zip(plain.logprobs[1:same], fp8[0].logprobs[1:same], strict=True)) > 1e-5
    )


# ---------------------------------------------------------------------------------------- refusals
def test_settings_an_fp8_cache_cannot_run_with_are_refused(tiny_model):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, not 'fp16'"):
        EngineConfig(kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="exact_logprobs cannot run with an FP8 KV cache"):
        EngineConfig(kv_cache_dtype="fp8", exact_logprobs=True)
    with pytest.raises(ValueError, match="needs tp_size 1"):
        EngineConfig(kv_cache_dtype="fp8", tp_size=2)
    config = cpu_config(kv_cache_dtype="fp8")
    for family in ("gemma2", "gemma3_text", "gemma4_text", "gpt_oss", "deepseek_v3", "gemma3", "gemma4"):
        assert family_problem(config, family).startswith(
            f"fp8_kv_cache is not supported for the {family} family"
        )
    for family in ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_5_text", "qwen2_5_vl", "qwen3_vl"):
        assert family_problem(config, family) is None
    assert "FP8 KV cache" in fallback_problem(config, "bert")
    with pytest.raises(ValueError, match="fp8_kv_cache is not supported for the gemma2 family"):
        LLMEngine(tiny_model("gemma2"), config)


def test_the_flags_reach_the_engine_and_refuse_exact_mode():
    from tidal.config.engine import engine_config, engine_knobs, rollout_engine_config
    from tidal.config.rollout import RolloutConfig
    from tidal.config.serve import ServeConfig

    assert (
        rollout_engine_config(RolloutConfig(rollout_kv_cache_dtype="fp8"), "cpu", 0).kv_cache_dtype == "fp8"
    )
    with pytest.raises(ConfigError, match="--exact_logprobs cannot run with --rollout_kv_cache_dtype fp8"):
        RolloutConfig(rollout_kv_cache_dtype="fp8", exact_logprobs=True)
    with pytest.raises(ConfigError, match="--rollout_kv_cache_dtype fp8 needs --vllm_tensor_parallel_size 1"):
        RolloutConfig(rollout_kv_cache_dtype="fp8", vllm_tensor_parallel_size=2)
    assert engine_knobs(ServeConfig(rollout_kv_cache_dtype="fp8"))["kv_cache_dtype"] == "fp8"
    with pytest.raises(ConfigError, match="exact_logprobs cannot run with an FP8 KV cache"):
        engine_config(max_num_seqs=4, max_model_len=64, gpu_memory_utilization=0.5, seed=0,
                      kv_cache_dtype="fp8", exact_logprobs=True)  # fmt: skip


# ----------------------------------------------------------------------- Triton kernels, interpreted
KERNELS = {
    "tidal.rollout.kernels.triton_e4m3": "store_e4m3_row",
    "tidal.rollout.models.triton_fused": "_rope_store_kv_kernel",
    "tidal.rollout.kernels.triton_attention": "_decode_kernel",
    "tidal.rollout.kernels.triton_context": "_context_kernel",
}


def _fp8_cache(gen, blocks, block_size, kv_heads, head_dim):
    full = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=gen)
    full[:, ::3] *= 40.0  # rows of different sizes: each scale matters
    q, scales = kv_cache.quantize_heads(full.view(-1, kv_heads, head_dim))
    return q.view(full.shape), scales.view(full.shape[:-1]).contiguous()


@pytest.mark.parametrize("window, splits", [(None, 1), (7, 2), (None, 4)])
def test_interpreted_decode_kernel_reads_the_fp8_cache_as_the_torch_path(window, splits):
    with interpreted(KERNELS) as (_, _, module, _):
        gen = torch.Generator().manual_seed(splits)
        heads, kv_heads, head_dim, batch, blocks, block_size = 8, 4, 32, 4, 64, 4
        cache, scales = _fp8_cache(gen, blocks, block_size, kv_heads, head_dim)
        tables = torch.stack([torch.randperm(blocks, generator=gen)[:16] for _ in range(batch)])
        ctx = torch.tensor([40, 1, 0, 13], dtype=torch.int32)
        q = torch.randn(batch, heads + 1, head_dim, generator=gen)[:, :heads]
        meta = AttentionMetadata(
            is_prefill=False, slot_mapping=None, kv_cache=cache[None], block_tables=tables, context_lens=ctx
        )
        ref = attention.torch_decode_attention(q, cache, meta, window, 0.2, scales)
        tiles = module.Tiles(block_n=8, num_warps=1, num_stages=1)
        out = module.paged_decode_attention(
            q, cache, tables.int(), ctx, window, 0.2, splits, tiles, kv_scales=scales
        )
        live = ctx > 0
        # float32 either way; the kernel scales the logits, torch the keys (rows of 40x: relative bounds)
        torch.testing.assert_close(out[live], ref[live], atol=1e-5 * ref.abs().max(), rtol=1e-4)
        # The scales are read: without them the result is another one.
        ones = torch.ones_like(scales)
        wrong = module.paged_decode_attention(
            q, cache, tables.int(), ctx, window, 0.2, splits, tiles, kv_scales=ones
        )
        assert (wrong[live] - ref[live]).abs().max() > 1e-2


def test_interpreted_fp8_stores_round_as_the_torch_store():
    """``rope_store_kv`` into an FP8 cache and the fused RoPE + store + decode kernel store the same bytes and
    scales, and those are the torch store's bytes, except where the interpreter's e4m3 cast rounds a value
    that carries into the next binade (torch's value a power of two) down to the binade below (the GPU
    test checks every byte)."""
    with interpreted(KERNELS) as (_, tf, module, _):
        gen = torch.Generator().manual_seed(3)
        heads, kv_heads, head_dim, batch, blocks, block_size = 8, 4, 32, 4, 64, 4
        cache, scales = _fp8_cache(gen, blocks, block_size, kv_heads, head_dim)
        tables = torch.stack([torch.randperm(blocks - 1, generator=gen)[:16] for _ in range(batch)])
        ctx = torch.tensor([40, 1, 0, 13], dtype=torch.int32)
        pos = (ctx - 1).clamp(min=0).long()
        own = tables[torch.arange(batch), pos // block_size] * block_size + pos % block_size
        slots = torch.where(ctx > 0, own, (blocks - 1) * block_size)
        qkv = torch.randn(batch, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3
        angles = torch.rand(batch, head_dim // 2, generator=gen) * 100
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        qk = qkv[:, : (heads + kv_heads) * head_dim].view(batch, -1, head_dim)
        v = qkv[:, (heads + kv_heads) * head_dim :].view(batch, kv_heads, head_dim)

        two_step = (cache.clone(), scales.clone())
        q, k = tf.rope_store_kv(qk, v, cos, sin, heads, two_step[0], slots, layer_scales=two_step[1])
        tiles = module.Tiles(block_n=8, num_warps=1, num_stages=1)
        ref = module.paged_decode_attention(
            q, two_step[0], tables.int(), ctx, None, 0.2, 2, tiles, kv_scales=two_step[1]
        )
        fused = (cache.clone(), scales.clone())
        rope = module.RopeInputs(cos, sin, slots)
        out = module.paged_decode_attention(
            qkv.view(batch, -1, head_dim),
            fused[0],
            tables.int(),
            ctx,
            None,
            0.2,
            2,
            tiles,
            rope,
            kv_scales=fused[1],
        )
        assert torch.equal(out, ref) and torch.equal(fused[1], two_step[1])
        assert torch.equal(fused[0].view(torch.uint8), two_step[0].view(torch.uint8))
        by_torch = (cache.clone(), scales.clone())
        kv_cache.store(by_torch[0], by_torch[1], k, v, slots)
        assert torch.equal(by_torch[1], two_step[1])
        got, want = two_step[0].view(torch.uint8), by_torch[0].view(torch.uint8)
        assert ((got == want) | (want & 0b111 == 0)).all()  # e4m3: 3 mantissa bits, 0 for a power of two
        assert (got != want).float().mean() < 0.05


def test_interpreted_context_kernel_reads_the_fp8_cache_as_the_torch_path():
    from tests.rollout.test_triton_context import TINY_BATCH, make_case

    with interpreted(KERNELS) as (_, _, _, _):
        q, cache, meta = make_case(TINY_BATCH, 6, 2, 16, 4, torch.float32, "cpu", seed=5)
        cache[:, ::2] *= 30.0
        quantized, scales = kv_cache.quantize_heads(cache.view(-1, *cache.shape[-2:]))
        fp8, scales = quantized.view(cache.shape), scales.view(cache.shape[:-1]).contiguous()
        meta.kv_cache = fp8[None]
        for splits in (1, 4):
            out = attention.context_kernel_attention(q, fp8, meta, 6, 0.3, splits, layer_scales=scales)
            ref = attention.torch_context_prefill_attention(q, fp8, meta, 6, 0.3, scales)
            torch.testing.assert_close(out, ref, atol=1e-5 * ref.abs().max(), rtol=1e-4)
