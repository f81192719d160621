"""Benchmark-style check: does the sampler on this device draw from the exact distribution?

Two parts, each against exact probabilities (``tidal.testing.stats``), with honest multinomial draws
(``torch.multinomial``) in the same run as the reference:

1. ``kernel``: ``Sampler`` as the engine calls it (on CUDA the fused Triton kernel) on a 152k vocabulary,
   bf16 logits of a peaked distribution, ``--rows`` samples at temperatures 1.0 and 0.7: chi-square per
   degree of freedom and z-score, and the mean number of distinct tokens among n=8 samples of a request.
2. ``engine``: ``LLMEngine`` end to end on a peaked tiny model: first (prefill) and second (decode)
   tokens against a ``transformers`` forward of the same weights, CUDA graphs on and off.

Prints one JSON line. chi2/dof near 1 and |z| below ~5 mean the sampler is right.

    python bench/sampling_check.py                 # CPU
    python bench/sampling_check.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

from tidal.rollout import EngineConfig, LLMEngine, SamplingParams
from tidal.rollout.runner.sampler import Sampler, SamplingTensors, sequence_seed
from tidal.testing import build_tiny_model
from tidal.testing.sampling_check import check_engine_sampling
from tidal.testing.stats import expected_distinct, goodness_of_fit, mean_z


def peaked_logits(vocab: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(vocab, generator=g) * 2
    logits[:50] += torch.linspace(8, 3, 50)
    return logits.to(device)


def _summary(tokens: torch.Tensor, probs: torch.Tensor, n: int) -> dict:
    fit = goodness_of_fit(torch.bincount(tokens.cpu(), minlength=probs.numel()), probs)
    distinct = torch.tensor([len(set(g.tolist())) for g in tokens.view(-1, n).cpu()], dtype=torch.float64)
    want = expected_distinct(probs, n)
    return {
        "chi2_per_dof": round(fit.ratio, 3),
        "z": round(fit.z, 2),
        "distinct": round(distinct.mean().item(), 3),
        "distinct_expected": round(want, 3),
        "distinct_z": round(mean_z(distinct, want), 2),
    }


def kernel_check(device, vocab: int, rows: int, temperature: float, n: int = 8, chunk: int = 1024) -> dict:
    logits = peaked_logits(vocab, device).to(torch.bfloat16)
    probs = (logits.double().cpu() / temperature).softmax(-1)
    sampler = Sampler(fused=True)
    ours, honest = [], []
    gen = torch.Generator(device=device).manual_seed(0)
    for start in range(0, rows, chunk):
        r = torch.arange(start, start + chunk)
        st = SamplingTensors(
            all_greedy=False,
            temperatures=torch.full((chunk,), temperature, device=device),
            seeds=torch.tensor([sequence_seed(int(i) // n, int(i) % n) for i in r], device=device),
            positions=torch.full((chunk,), 5, dtype=torch.int64, device=device),
        )
        ours.append(sampler(logits.expand(chunk, vocab), st)[0])
        honest.append(torch.multinomial(probs.float().to(device), chunk, replacement=True, generator=gen))
    return {
        "tidal": _summary(torch.cat(ours), probs, n),
        "multinomial": _summary(torch.cat(honest), probs, n),
    }


def engine_check(device: str, requests: int) -> dict:
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tempfile.mkdtemp(), "llama", seed=0, logit_scale=8.0)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
    out = {}
    for eager in (False, True) if device == "cuda" else (True,):
        config = EngineConfig(device=device, dtype="float32", max_model_len=64, enforce_eager=eager)
        engine = LLMEngine(path, config)
        for name, params in (
            ("t1", SamplingParams(n=8, temperature=1.0)),
            ("t0.7_topp0.9", SamplingParams(n=8, temperature=0.7, top_p=0.9)),
        ):
            report = check_engine_sampling(engine, hf, list(range(10, 40)), params, requests)
            out[f"{'eager' if eager else 'graphs'}_{name}"] = report.as_dict()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--requests", type=int, default=2048, help="engine requests (n=8 samples each)")
    args = parser.parse_args()
    device = torch.device(args.device)
    result = {
        "bench": "sampling_check",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "kernel_t1": kernel_check(device, args.vocab, args.rows, 1.0),
        "kernel_t0.7": kernel_check(device, args.vocab, args.rows, 0.7),
        "engine": engine_check(args.device, args.requests),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
