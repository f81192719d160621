"""Benchmark: tidal's supervised training step vs a plain Hugging Face training loop, in one run.

Workload: random-init models of Qwen2.5 shapes, ``--samples`` random token sequences per optimizer step
with lengths uniform in [``--min_len``, ``--max_len``], ``--micro`` sequences per micro-batch, bf16
autocast over float32 master weights, fused AdamW, gradient clipping at 1.0.

- ``tidal``: ``SupervisedTrainer.train_step`` with ``SFTObjective(packing=True)``: every micro-batch is
  one packed row (varlen flash attention on CUDA, no padding) and log-probs come from the chunked LM
  head (no [tokens, vocab] logits); ``tidal_ckpt`` adds activation checkpointing
  (``--gradient_checkpointing``); ``tidal_mask`` packs with the 4-D block mask instead of varlen and
  ``tidal_full_logits`` turns the chunked head off (first config only, to show each change);
  ``tidal_compile`` (``tidal_compile_ckpt``) adds ``--torch_compile`` (each block compiled, dynamic
  shapes; compilation happens in the warm-up steps).
- ``hf``: ``model(input_ids, attention_mask, labels).loss.backward()`` + AdamW on the same micro-batches,
  right-padded to their longest sequence (SDPA).

Reported per variant: step time (median of ``--steps`` after ``--warmup``), real (non-padding)
tokens/s, peak memory (``torch.cuda.max_memory_allocated``) and MFU:

    FLOPs per step = 6·N·tokens + 12·L·h·Σ s_i²        (per sequence of length s_i)
    MFU            = FLOPs per step / step time / peak

N counts the parameters used in matmuls (all of them for tied embeddings: the LM head reuses the
embedding matrix; the embedding lookup itself is free), L layers, h hidden size. 12·L·h·s² is the
attention score and value matmuls forward and backward without causal savings (PaLM's convention);
``mfu_causal`` counts only the causal half (6·L·h·s²). Recomputation under checkpointing is not
counted. The peak is measured in the same run: an 8192³ bf16 ``torch.matmul`` on random data.
``--attention_bench`` also times packed attention alone (forward + backward): SDPA with the 4-D mask,
tidal's varlen kernel and FlexAttention with a document block mask (compiled).

    python bench/train_step.py                          # tiny model on CPU, < 1 minute
    python bench/train_step.py --device cuda --configs qwen2.5-0.5b qwen2.5-1.5b --attention_bench
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
import types

import torch

CONFIGS = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=1024, bos_token_id=1, eos_token_id=2),
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, vocab_size=151936),
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
}  # fmt: skip
COMMON = dict(model_type="qwen2", tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=32768,
              rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645)  # fmt: skip


def stub_missing_datasets() -> None:
    """The GPU image has no ``datasets``; tidal.data imports it at module level but these benchmarks
    read no dataset files, so an empty module stands in."""
    try:
        import datasets  # noqa: F401
    except ImportError:
        sys.modules["datasets"] = types.ModuleType("datasets")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["tiny"], choices=sorted(CONFIGS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--samples", type=int, default=64, help="sequences per optimizer step")
    p.add_argument("--micro", type=int, default=16, help="sequences per micro-batch")
    p.add_argument("--min_len", type=int, default=128)
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--variants", nargs="+", default=["tidal", "tidal_ckpt", "hf"])
    p.add_argument("--extra_variants", nargs="*", default=["tidal_mask", "tidal_full_logits"],
                   help="variants run on the first config only")  # fmt: skip
    p.add_argument("--attention_bench", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.device == "cpu" and args.max_len == 2048 and args.configs == ["tiny"]:
        args.min_len, args.max_len, args.samples, args.micro = 16, 64, 8, 4
    return args


# ---- shared pieces (bench/rl_step.py imports them) -----------------------------------------------
def model_config(name: str, **overrides):
    """The Hugging Face config of ``CONFIGS[name]`` (a config's own fields override ``COMMON``'s, e.g. the
    untied embeddings of the 7B), with ``overrides`` on top."""
    from transformers import AutoConfig

    fields = dict(COMMON, **CONFIGS[name], **overrides)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def make_model(
    name: str, device: torch.device, gradient_checkpointing: bool = False, seed: int = 0, **overrides
):
    """Random-init float32 (master-weight) causal LM with SDPA attention, built on ``device``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with device:
        model = AutoModelForCausalLM.from_config(
            model_config(name, **overrides), dtype=torch.float32, attn_implementation="sdpa"
        )
    model.config.use_cache = False
    if gradient_checkpointing:  # as tidal.models.load_causal_lm does for --gradient_checkpointing
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def matmul_peak_tflops(device: torch.device, n: int = 8192, reps: int = 20) -> float | None:
    """Dense bf16 matmul rate on random data (the MFU denominator); None on the CPU."""
    if device.type != "cuda":
        return None
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (start.elapsed_time(end) / 1e3) / 1e12


def matmul_params(model) -> int:
    """Parameters used in matmuls: all for tied embeddings (the head reuses them), minus the lookup table
    otherwise."""
    total = sum(p.numel() for p in model.parameters())
    if model.config.tie_word_embeddings:
        return total
    return total - model.get_input_embeddings().weight.numel()


def train_flops(model, lengths: list[int]) -> tuple[float, float]:
    """(FLOPs with 12·L·h·s² attention, FLOPs with the causal 6·L·h·s²) of one step over ``lengths``."""
    c = model.config
    dense = 6 * matmul_params(model) * sum(lengths)
    attn = 12 * c.num_hidden_layers * c.hidden_size * sum(s * s for s in lengths)
    return dense + attn, dense + attn / 2


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gb(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None


def versions() -> dict:
    import transformers

    info = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


# ---- workload ------------------------------------------------------------------------------------
def make_samples(n: int, vocab: int, min_len: int, max_len: int, seed: int):
    from tidal.data.sft import SFTSample

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [
        SFTSample(torch.randint(0, vocab, (s,), generator=g).tolist(), [0] + [1] * (s - 1)) for s in lengths
    ]


def time_steps(step, device: torch.device, steps: int, warmup: int):
    """(median seconds of ``steps`` timed calls after ``warmup`` untimed ones, the first call's result)."""
    first = step()
    for _ in range(warmup - 1):
        step()
    sync(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), first


def optimization(model, device: torch.device):
    from tidal.config import OptimConfig
    from tidal.models.precision import Precision
    from tidal.trainers.optim import build_optimizer
    from tidal.trainers.optimization import Optimization

    optimizer = build_optimizer(model, OptimConfig(learning_rate=1e-5))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return Optimization(model, optimizer, scheduler, Precision.create("auto", device), max_norm=1.0)


def tidal_step(model, samples, args, device: torch.device):
    """A closure running one ``SupervisedTrainer.train_step`` over ``samples`` (packed micro-batches)."""
    from tidal.config import CheckpointConfig, TrainConfig
    from tidal.distributed.world import World
    from tidal.logging import LoggingConfig
    from tidal.trainers.loop import SupervisedTrainer
    from tidal.trainers.sft import SFTObjective

    train_cfg = TrainConfig(
        train_batch_size=len(samples), micro_train_batch_size=args.micro, packing_samples=True
    )
    trainer = SupervisedTrainer(
        SFTObjective(pad_id=0, packing=True), optimization(model, device), None, World(device=device),
        train_cfg, CheckpointConfig(), LoggingConfig(), "/tmp/tidal_bench_run",
    )  # fmt: skip
    return lambda: trainer.train_step(samples)


def hf_step(model, samples, micro: int, device: torch.device):
    """A closure running one plain HF step: padded micro-batches, ``labels=``, backward, clip, AdamW."""
    from tidal.data import collate_padded

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), fused=device.type == "cuda")
    batches = []
    for i in range(0, len(samples), micro):
        b = collate_padded(samples[i : i + micro], 0)
        labels = b["input_ids"].masked_fill(b["attention_mask"] == 0, -100)
        batches.append({"input_ids": b["input_ids"], "attention_mask": b["attention_mask"], "labels": labels})
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def step():
        for b in batches:
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
                loss = model(**b).loss / len(batches)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, sum(int(b["input_ids"].numel()) for b in batches)


def run_variant(name: str, variant: str, samples, args, device: torch.device, peak: float | None) -> dict:
    """Time one variant; a plain HF run that runs out of memory is retried with half the micro-batch
    (same samples per step, more accumulation) and says so."""
    micro, ooms = args.micro, []
    while True:
        try:
            result = _run_variant(name, variant, samples, args, micro, device, peak)
            break
        except torch.OutOfMemoryError:
            if not variant.startswith("hf") or micro == 1:
                raise
            ooms.append(micro)
            micro //= 2
    if ooms:
        result["out_of_memory_at_micro"], result["micro"] = ooms, micro
    return result


def _run_variant(name, variant, samples, args, micro, device, peak) -> dict:
    import tidal.models.forward as forward

    reset_memory(device)
    model = make_model(name, device, gradient_checkpointing=variant.endswith("_ckpt"), seed=args.seed)
    if variant.startswith("tidal_compile"):  # --torch_compile: regional compilation of the blocks
        from tidal.models.compile import compile_blocks

        compile_blocks(model)
    saved = (forward.PACKED_ATTENTION, forward.chunkable_head)
    forward.PACKED_ATTENTION = "mask" if variant == "tidal_mask" else "auto"
    if variant == "tidal_full_logits":
        forward.chunkable_head = lambda _model: None
    try:
        padded_tokens = None
        if variant.startswith("hf"):
            step, padded_tokens = hf_step(model, samples, micro, device)
        else:
            step = tidal_step(model, samples, args, device)
        seconds, first = time_steps(step, device, args.steps, args.warmup)
    finally:
        forward.PACKED_ATTENTION, forward.chunkable_head = saved
        step = None
    lengths = [len(s) for s in samples]
    flops, flops_causal = train_flops(model, lengths)
    result = {
        "step_s": round(seconds, 4),
        "tokens_per_s": round(sum(lengths) / seconds),
        "peak_mem_gb": peak_gb(device),
        "attn_impl": model.config._attn_implementation,
    }
    if isinstance(first, dict):  # same model seed and data: the variants' first losses must agree
        result["first_loss"] = round(first["loss"], 5)
    if padded_tokens:
        result["padding_fraction"] = round(1 - sum(lengths) / padded_tokens, 3)
    if peak:
        result["mfu"] = round(flops / seconds / 1e12 / peak, 4)
        result["mfu_causal"] = round(flops_causal / seconds / 1e12 / peak, 4)
    del model
    return result


# ---- packed attention alone ------------------------------------------------------------------------
def attention_bench(name: str, args, device: torch.device) -> dict:
    """Forward + backward of one layer's packed attention, ms (median): 4-D mask SDPA, varlen, flex."""
    import triton.testing

    from tidal.models.packed_attention import _varlen

    c = model_config(name)
    heads, kv, dim = c.num_attention_heads, c.num_key_value_heads, c.hidden_size // c.num_attention_heads
    g = torch.Generator().manual_seed(args.seed)
    lengths, total = [], 0
    while total < 16384:
        s = min(int(torch.randint(args.min_len, args.max_len + 1, (1,), generator=g)), 16384 - total)
        lengths.append(s)
        total += s
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)
    cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(device, torch.int32)
    q = torch.randn(1, heads, total, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    k, v = (
        torch.randn(1, kv, total, dim, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in "kv"
    )
    grad = torch.randn(1, heads, total, dim, device=device, dtype=torch.bfloat16)
    mask = (
        torch.ones(total, total, dtype=torch.bool, device=device).tril() & (seg[:, None] == seg[None, :])
    )[None, None]

    def sdpa():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).backward(
            grad
        )

    def varlen():
        out = _varlen(
            q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, max(lengths), None
        )
        out.transpose(0, 1)[None].backward(grad)

    out = {"tokens": total, "sequences": len(lengths)}
    for label, fn in (("sdpa_4d_mask_ms", sdpa), ("varlen_ms", varlen)):
        out[label] = round(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"), 3)
    print(f"# attention: {out}", file=sys.stderr, flush=True)
    try:
        out["flex_ms"], out["flex_compile_s"] = _flex(q, k, v, grad, seg, total)
    except Exception as err:  # report, don't lose the other numbers
        out["flex_error"] = f"{type(err).__name__}: {err}"[:300]
    return out


def _flex(q, k, v, grad, seg, total):
    import triton.testing
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def document_causal(b, h, q_idx, kv_idx):
        return (seg[q_idx] == seg[kv_idx]) & (q_idx >= kv_idx)

    block_mask = create_block_mask(document_causal, None, None, total, total, device=q.device)
    compiled = torch.compile(flex_attention, dynamic=False)

    def flex():
        compiled(q, k, v, block_mask=block_mask, enable_gqa=True).backward(grad)

    start = time.perf_counter()
    flex()
    torch.cuda.synchronize()
    compile_s = round(time.perf_counter() - start, 1)
    return round(triton.testing.do_bench(flex, warmup=25, rep=200, return_mode="median"), 3), compile_s


def main(argv=None) -> dict:
    args = parse_args(argv)
    stub_missing_datasets()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    peak = matmul_peak_tflops(device)
    report = {"bench": "train_step", **versions(), "device": args.device, "peak_bf16_tflops": peak and round(peak, 1),
              "samples_per_step": args.samples, "micro": args.micro, "len_range": [args.min_len, args.max_len]}  # fmt: skip
    for i, name in enumerate(args.configs):
        samples = make_samples(
            args.samples, CONFIGS[name]["vocab_size"], args.min_len, args.max_len, args.seed
        )
        variants = args.variants + (args.extra_variants if i == 0 else [])
        entry = {"tokens_per_step": sum(len(s) for s in samples)}
        for variant in variants:
            entry[variant] = run_variant(name, variant, samples, args, device, peak)
            print(f"# {name} {variant}: {entry[variant]}", file=sys.stderr, flush=True)
        if "hf" in entry and "tidal" in entry:
            entry["speedup_vs_hf"] = round(entry["tidal"]["tokens_per_s"] / entry["hf"]["tokens_per_s"], 2)
        report[name] = entry
    if args.attention_bench and device.type == "cuda":  # last: FlexAttention compiles
        report["attention"] = {"config": args.configs[0], **attention_bench(args.configs[0], args, device)}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
