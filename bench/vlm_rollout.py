"""Benchmark: tidal's rollout engine vs ``transformers.generate`` on vision-language prompts (issue #32).

Each of ``--batch`` prompts carries one seeded synthetic ``--image_side``² RGB image
(``vlm_shapes.synthetic_images``) and ``--text_len`` random text tokens: ``<|vision_start|>
<|image_pad|><|vision_end|>`` then the text. Greedy decoding, every sample runs exactly ``--new_tokens``
tokens (our engine: ``ignore_eos``; HF: ``min_new_tokens``). Both sides start from the PIL images, so
both timings include the image processor, the vision tower and the prompt's prefill:

- ours: ``LLMEngine.generate(prompts, params, multi_modal=[MultiModalInput(images=[img])])``, CUDA graphs
  on (the engine expands the single placeholder to the image's token count);
- HF: ``AutoModelForImageTextToText.generate`` on the image processor's ``pixel_values`` /
  ``image_grid_thw``, the expanded prompts and, where the model takes them, ``mm_token_type_ids`` (1 on
  image tokens: what its processor returns; transformers 5.24's Qwen3-VL ``generate`` without them gives
  a text prompt's M-RoPE positions) and the image / video placeholders suppressed (our engine never samples
  them), one batch (all prompts have the same length, so the left
  padding a batch would need is absent).

The JSON line has tokens/s of both and the ratio (ours / HF), and per side ``prefill_s`` (a run of one new
token: image processor + vision tower + prompt prefill) and ``decode_step_ms`` ((full run - prefill run) /
(new_tokens - 1)); ``greedy_match``: the fraction of samples whose tokens are the same on both sides
(bf16 random-init models drift apart after some tokens, as in ``bench/rollout.py``).

Shapes (``--config``, ``bench/vlm_shapes.py``): ``qwen2.5-vl-3b``, ``qwen2.5-vl-7b``, ``qwen3-vl-8b``,
random-init bf16 built directly on the device, with the released image processor's settings (448×448:
256 image tokens for Qwen2.5-VL, 196 for Qwen3-VL). ``--tiny FAMILY``: ``tidal.testing.build_tiny_vlm``'s
model of that family (its processor scales images down to at most 4 image tokens), a CPU smoke run.

    python bench/vlm_rollout.py --tiny qwen2_5_vl                    # CPU smoke run, < 1 minute
    python bench/vlm_rollout.py --tiny qwen3_vl --batch 4 --new_tokens 8
    python bench/vlm_rollout.py --config qwen2.5-vl-3b --device cuda --batch 64 --new_tokens 256
    python bench/vlm_rollout.py --config qwen3-vl-8b --device cuda --batch 64 --new_tokens 256
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout import DTYPES, timed  # noqa: E402
from vlm_shapes import VLM_SHAPES, synthetic_images, vlm_config, vlm_image_processor  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", choices=sorted(VLM_SHAPES), help="random-init model of this shape")
    source.add_argument("--tiny", metavar="FAMILY", help="tidal.testing.build_tiny_vlm's model (CPU smoke)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--image_side", type=int, default=448, help="pixels per side of each prompt's image")
    p.add_argument("--text_len", type=int, default=32, help="random text tokens after the image")
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="timed runs per side (best is reported)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--enforce_eager", action="store_true", help="our engine without CUDA graphs")
    p.add_argument("--skip_hf", action="store_true", help="time our engine only")
    args = p.parse_args(argv)
    if args.batch < 1 or args.new_tokens < 2 or args.text_len < 1:
        p.error("--batch and --text_len must be >= 1 and --new_tokens >= 2 (decode steps are timed)")
    return args


def load_model(args, dtype: torch.dtype, tmp: str):
    """(HF model in eval mode, its folder or None, the image processor)."""
    from transformers import AutoModelForImageTextToText

    if args.config:
        config = vlm_config(args.config)
        torch.manual_seed(args.seed)
        with torch.device(args.device):  # initialised on the GPU: seconds, not minutes
            model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
        return model.eval(), None, vlm_image_processor(args.config)
    from tidal.rollout.engine.loading import load_image_processor
    from tidal.testing import build_tiny_vlm

    try:
        path = build_tiny_vlm(Path(tmp) / "tiny", args.tiny, seed=args.seed)
    except ValueError as err:
        raise SystemExit(f"--tiny: {err}") from None
    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=dtype).to(args.device)
    return model.eval(), str(path), load_image_processor(path)


def build_prompts(config, args) -> list[list[int]]:
    """Each prompt: the image placeholder once (``<|vision_start|><|image_pad|><|vision_end|>``), then
    ``--text_len`` random token ids below the special tokens."""
    gen = torch.Generator().manual_seed(args.seed)
    low = min(config.vision_start_token_id, config.image_token_id, config.get_text_config().vocab_size)
    text = torch.randint(5, min(low, 100_000), (args.batch, args.text_len), generator=gen).tolist()
    head = [config.vision_start_token_id, config.image_token_id, config.vision_end_token_id]
    return [head + row for row in text]


def expand(prompts: list[list[int]], image_token: int, counts: list[int]) -> torch.Tensor:
    """The prompts with each image placeholder repeated to its image's token count (what HF takes)."""
    rows = []
    for ids, count in zip(prompts, counts, strict=True):
        at = ids.index(image_token)
        rows.append(ids[:at] + [image_token] * count + ids[at + 1 :])
    return torch.tensor(rows)


def hf_runner(hf, processor, images, prompts, device: str):
    """A function ``n -> token lists`` that runs HF's processor and ``generate`` for ``n`` new tokens."""
    merge = processor.merge_size
    # our engine never samples the image and video placeholders (a response holding them would be taken
    # for images by the trainer's model): HF suppresses them too, so the greedy samples can match
    never = [hf.config.image_token_id, hf.config.video_token_id]
    takes_types = "mm_token_type_ids" in inspect.signature(hf.forward).parameters  # newer transformers

    def run(n: int) -> list[list[int]]:
        pixels = processor(images=images, return_tensors="pt")
        grid = pixels["image_grid_thw"]
        counts = (grid.prod(-1) // merge**2).tolist()
        ids = expand(prompts, hf.config.image_token_id, counts).to(device)
        extra = {}
        if takes_types:  # transformers' M-RoPE positions need them (its processor returns them)
            extra["mm_token_type_ids"] = (ids == hf.config.image_token_id).int()
        with torch.inference_mode():
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), **extra,
                pixel_values=pixels["pixel_values"].to(device, hf.dtype), image_grid_thw=grid.to(device),
                do_sample=False, temperature=None, top_p=None, top_k=None, max_new_tokens=n, min_new_tokens=n,
                suppress_tokens=never,
            )  # fmt: skip
        return out[:, ids.shape[1] :].tolist()

    return run


def our_runner(engine, images, prompts):
    """A function ``n -> token lists`` that runs our engine on the PIL images for ``n`` new tokens."""
    from tidal.rollout import SamplingParams
    from tidal.rollout.runner.multimodal import MultiModalInput

    def run(n: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
        mm = [MultiModalInput(images=[img]) for img in images]
        return [o.outputs[0].token_ids for o in engine.generate(prompts, params, multi_modal=mm)]

    return run


def time_side(run, args) -> dict:
    """Warm-up, then the best of ``--repeats`` full runs and prefill-only runs."""
    run(2)  # first-call allocations, kernel selection and CUDA graph capture stay out of the timings
    full = min(
        (timed(lambda: run(args.new_tokens), args.device) for _ in range(args.repeats)), key=lambda r: r[0]
    )
    prefill = min(timed(lambda: run(1), args.device)[0] for _ in range(args.repeats))
    generated = sum(len(t) for t in full[1])
    return {
        "tokens_per_s": round(generated / full[0], 1),
        "s": round(full[0], 3),
        "prefill_s": round(prefill, 4),
        "decode_step_ms": round((full[0] - prefill) / (args.new_tokens - 1) * 1e3, 3),
        "tokens": full[1],
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tidal.rollout import EngineConfig, LLMEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES.get(args.dtype) or (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        hf, path, processor = load_model(args, dtype, tmp)
        images = synthetic_images(args.batch, args.image_side, args.seed)
        prompts = build_prompts(hf.config, args)
        grid = processor(images=images[:1], return_tensors="pt")["image_grid_thw"][0]
        image_tokens = int(grid.prod()) // processor.merge_size**2
        sides = {}
        if not args.skip_hf:  # HF first: its activations are freed before the engine takes its KV cache
            sides["hf"] = time_side(hf_runner(hf, processor, images, prompts, args.device), args)
        config = EngineConfig(
            max_num_seqs=args.batch, max_model_len=len(prompts[0]) + image_tokens + args.new_tokens,
            dtype=str(dtype).removeprefix("torch."), device=args.device, seed=args.seed,
            enforce_eager=args.enforce_eager,
        )  # fmt: skip
        engine = LLMEngine(path, config, model=hf, image_processor=processor)
        sides["tidal"] = time_side(our_runner(engine, images, prompts), args)
        cuda_graphs = engine.runner.graphs is not None
        engine.close()
    result = {
        "bench": "vlm_rollout",
        "model": args.config or f"tiny-{args.tiny}",
        "model_type": hf.config.model_type,
        "params_b": round(sum(p.numel() for p in hf.parameters()) / 1e9, 3),
        "vision_params_b": round(sum(p.numel() for p in hf.model.visual.parameters()) / 1e9, 3),
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "dtype": str(dtype).removeprefix("torch."),
        "batch": args.batch,
        "image_side": args.image_side,
        "image_tokens": image_tokens,
        "prompt_len": len(prompts[0]) - 1 + image_tokens,
        "new_tokens": args.new_tokens,
        "cuda_graphs": cuda_graphs,
    }
    ours = sides["tidal"]
    result.update({f"tidal_{k}": v for k, v in ours.items() if k != "tokens"})
    if "hf" in sides:
        theirs = sides["hf"]
        result.update({f"hf_{k}": v for k, v in theirs.items() if k != "tokens"})
        result["ratio"] = round(ours["tokens_per_s"] / theirs["tokens_per_s"], 3)
        same = [a == b for a, b in zip(ours["tokens"], theirs["tokens"], strict=True)]
        result["greedy_match"] = round(sum(same) / args.batch, 3)
    result.update(torch=torch.__version__, threads=torch.get_num_threads(), machine=platform.machine())
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
