"""Where a vision-language prefill's time goes, tidal's engine vs ``transformers.generate`` (issue #32).

The same random-init model of a ``bench/vlm_shapes.py`` shape (optionally fewer tower blocks / language
layers, for a CPU run: ``--tower_depth`` keeps the last block a full-attention one), the same PIL images
(``--images`` of ``--image_side``², one per prompt, then ``--text_len`` text tokens), one new token, greedy.
Each stage is timed with ``perf_counter`` around the code that runs it (synchronising the GPU first):

- tidal: ``admit`` (``_encode_with_images`` per request: the image processor on the request's images,
  the placeholders' expansion, M-RoPE positions), ``tower`` (the vision tower's forward, all calls of
  the step(s)), ``rest`` (the whole ``generate`` less those: scheduling, the scatter of the features,
  the language prefill, sampling);
- HF: ``processor`` (one call on all images), ``tower`` (``model.visual``'s forward), ``rest``.

One JSON line: best of ``--repeats`` per side, each stage in seconds, and the two towers' attention
(``tidal_tower_attention``: ``vision_attention.SEGMENT_ATTENTION`` unless the config asks for flash) with
the SDPA calls each tower made (``tower_sdpa_calls``: per window and per image in transformers' SDPA
path, per run of equal segments in the engine's); ``processor_one_image_a_call``: the image processor
over the images one a call, serially (as the engine admits requests) and on a thread pool.

    python bench/vlm_prefill_stages.py --images 4 --tower_depth 8 --text_layers 2   # CPU, ~1 minute
    python bench/vlm_prefill_stages.py --device cuda --images 64                      # the full 3B shape
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vlm_rollout import build_prompts, hf_runner, our_runner  # noqa: E402
from vlm_shapes import VLM_SHAPES, synthetic_images, vlm_config, vlm_image_processor  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=sorted(VLM_SHAPES), default="qwen2.5-vl-3b")
    p.add_argument("--images", type=int, default=4, help="prompts, one image each")
    p.add_argument("--image_side", type=int, default=448)
    p.add_argument("--text_len", type=int, default=32)
    p.add_argument("--tower_depth", type=int, default=0, help="vision blocks (0: the shape's)")
    p.add_argument("--text_layers", type=int, default=0, help="language layers (0: the shape's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class Stopwatch:
    """Seconds spent inside wrapped callables, per stage name (the GPU synchronised around each call), and
    the SDPA calls made inside each (``F.scaled_dot_product_attention``, counted while the watch runs)."""

    def __init__(self, device: str):
        self.sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.sdpa_calls = 0
        sdpa = F.scaled_dot_product_attention

        def counted(*args, **kwargs):
            self.sdpa_calls += 1
            return sdpa(*args, **kwargs)

        F.scaled_dot_product_attention = counted  # transformers and the engine look it up at each call

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            self.sync()
            start, calls = time.perf_counter(), self.sdpa_calls
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                self.calls[name] = self.calls.get(name, 0) + self.sdpa_calls - calls

        return timed

    def run(self, fn) -> dict[str, float]:
        """``fn()``'s stages, with ``rest`` = its wall time less theirs."""
        self.seconds, self.calls = {}, {}
        total = self.wrap("total", fn)
        total()
        out = dict(self.seconds)
        out["rest"] = out["total"] - sum(v for k, v in out.items() if k != "total")
        out = {k: round(v, 4) for k, v in out.items()}
        out["tower_sdpa_calls"] = self.calls.get("tower", 0)
        return out


class TimedProcessor:
    """An image processor whose calls ``watch`` times (its attributes, e.g. ``merge_size``, passed on)."""

    def __init__(self, processor, watch: Stopwatch):
        self._processor, self._call = processor, watch.wrap("processor", processor)

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._processor, name)


def processor_threads(processor, images, repeats: int) -> dict[str, float]:
    """The image processor one image a call, serially and on a thread pool of the machine's cores (what
    processing a step's requests in parallel would save; the outputs are checked equal)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    def one(image):
        return processor(images=[image], return_tensors="pt")["pixel_values"]

    threads = min(16, os.cpu_count() or 1)
    with ThreadPoolExecutor(threads) as pool:
        runs = {"serial": lambda: [one(im) for im in images], "pool": lambda: list(pool.map(one, images))}
        seconds = {}
        for name, run in runs.items():
            run()
            seconds[name] = min(timed_once(run) for _ in range(repeats))
        assert all(torch.equal(a, b) for a, b in zip(runs["serial"](), runs["pool"](), strict=True))
    return {"serial_s": round(seconds["serial"], 4), "pool_s": round(seconds["pool"], 4), "threads": threads}


def timed_once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def best(watch: Stopwatch, fn, repeats: int) -> dict[str, float]:
    fn()  # warm-up
    return min((watch.run(fn) for _ in range(repeats)), key=lambda r: r["total"])


def model(args):
    from transformers import AutoModelForImageTextToText

    shape = VLM_SHAPES[args.config]
    text = {"num_hidden_layers": args.text_layers} if args.text_layers else None
    config = vlm_config(args.config, text_overrides=text)
    if args.tower_depth:  # the shape's window/full-attention structure, fewer blocks ending in a full one
        config.vision_config.depth = args.tower_depth
        if "fullatt_block_indexes" in shape["vision"]:
            config.vision_config.fullatt_block_indexes = [args.tower_depth - 1]
        if "deepstack_visual_indexes" in shape["vision"]:
            config.vision_config.deepstack_visual_indexes = [args.tower_depth - 1]
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        return AutoModelForImageTextToText.from_config(config, dtype=dtype).eval(), dtype


def main(argv=None) -> dict:
    args = parse_args(argv)
    from tidal.rollout import EngineConfig, LLMEngine

    hf, dtype = model(args)
    processor = vlm_image_processor(args.config)
    images = synthetic_images(args.images, args.image_side, args.seed)
    ns = argparse.Namespace(batch=args.images, text_len=args.text_len, seed=args.seed)
    prompts = build_prompts(hf.config, ns)
    watch = Stopwatch(args.device)

    hf_processor = TimedProcessor(processor, watch)
    hf_tower = hf.model.visual.forward
    hf.model.visual.forward = watch.wrap("tower", hf_tower)
    theirs = best(watch, lambda: hf_runner(hf, hf_processor, images, prompts, args.device)(1), args.repeats)
    hf.model.visual.forward = hf_tower

    tokens = len(prompts[0]) + 2048  # room for the image tokens and one new token
    config = EngineConfig(max_num_seqs=args.images, max_model_len=tokens, dtype=str(dtype).removeprefix("torch."),
                          device=args.device, seed=args.seed, enforce_eager=True)  # fmt: skip
    engine = LLMEngine(None, config, model=hf, image_processor=processor)
    engine._encode_with_images = watch.wrap("admit", engine._encode_with_images)
    engine.model.visual.forward = watch.wrap("tower", engine.model.visual.forward)
    ours = best(watch, lambda: our_runner(engine, images, prompts)(1), args.repeats)
    attention = engine.model.visual.config._attn_implementation
    engine.close()
    result = {
        "bench": "vlm_prefill_stages", "model": args.config, "device": args.device,
        "dtype": str(dtype).removeprefix("torch."), "images": args.images, "image_side": args.image_side,
        "tower_depth": hf.config.vision_config.depth, "text_layers": hf.config.get_text_config().num_hidden_layers,
        "tidal_s": ours, "hf_s": theirs, "tidal_tower_attention": attention,
        "hf_tower_attention": hf.model.visual.config._attn_implementation, "threads": torch.get_num_threads(),
        "processor_one_image_a_call": processor_threads(processor, images, args.repeats),
    }  # fmt: skip
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
