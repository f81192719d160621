"""Qwen3.5 on CUDA (skipped without a GPU): flash-linear-attention's kernels against the torch gated delta
rule, and the hybrid engine on the GPU (fla's kernels when installed, and the torch path): CUDA graphs and
async scheduling against the eager synchronous engine and transformers, n samples, requests joining and
finishing mid-decode. The "torch" cases decode through tidal's fused Triton kernel (the CUDA default,
``gated_delta.decode_path``); the last tests check that kernel at real shapes and the engine on it against
the torch rule."""

from __future__ import annotations

import pytest
import torch

from tests.rollout.reference import PROMPTS, cpu_config
from tidal.rollout import EngineConfig, LLMEngine, SamplingParams
from tidal.rollout.models import gated_delta

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "start",
    [
        "zero",
        pytest.param(
            "state",
            marks=pytest.mark.xfail(
                reason="fla 0.6.0's chunked kernel from a non-zero state differed by up to 0.28 on an H200 "
                "(why is open; the engine does not use fla by default)",
                strict=False,
            ),
        ),
    ],
)
@pytest.mark.parametrize("length", [1, 37, 130])
def test_fla_kernels_match_the_torch_rule(length, start):
    if not gated_delta.fla_installed():
        pytest.skip("flash-linear-attention is not installed")
    gen = torch.Generator(device="cuda").manual_seed(length)
    batch, k_heads, v_heads, k_dim, v_dim = 2, 2, 4, 64, 64

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q, k = rand(batch, length, k_heads, k_dim), rand(batch, length, k_heads, k_dim)
    v = rand(batch, length, v_heads, v_dim)
    g = -torch.rand(batch, length, v_heads, generator=gen, device="cuda")
    beta = torch.rand(batch, length, v_heads, generator=gen, device="cuda")
    state = rand(batch, v_heads, k_dim, v_dim) if start == "state" else None
    want_out, want_state = gated_delta.chunk_gated_delta_rule(q, k, v, g, beta, state)
    for recurrent in (False, True):
        out, final = gated_delta.fla_gated_delta_rule(q, k, v, g, beta, state, recurrent=recurrent)
        torch.testing.assert_close(out, want_out, atol=2e-3, rtol=0)  # fla's float32 dots run in TF32
        torch.testing.assert_close(final, want_state, atol=2e-3, rtol=0)


@torch.inference_mode()
def cuda_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """``reference.hf_logprobs`` on the GPU (with flash-linear-attention installed, transformers' Qwen3.5
    runs its kernels for CPU tensors too, which fails)."""
    logits = model(torch.tensor([prompt + output], device="cuda")).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(output, device="cuda")[:, None])[:, 0].cpu()


def assert_close_to_tf32(got: list[float], expected: torch.Tensor, family: str) -> None:
    """Log-probs against transformers running fla's kernels, whose float32 dots run in TF32 (~1e-3). A MoE
    router's top-k can flip on that noise and move a few tokens' log-probs by more (0.16 seen on an H200):
    for MoE most tokens must agree to the noise and none by more than a flip's size. The exact comparisons
    (CPU engine pinned to transformers on the CPU; graphs vs eager) are made separately, bit for bit or 1e-4."""
    diff = (torch.tensor(got) - expected).abs()
    if "moe" not in family:
        assert diff.max() < 2e-3, diff
        return
    assert (diff < 2e-3).float().mean() >= 0.75 and diff.max() < 0.5, diff


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text"])
@pytest.mark.parametrize("kernels", ["fla", "torch"])
def test_cuda_engine_matches_the_cpu_engine_and_transformers(family, kernels, tiny_model, monkeypatch):
    """The torch path: the CPU engine's tokens and log-probs (the CPU tests pin those to transformers).
    fla's kernels: transformers' own log-probs on the GPU (it runs the same kernels when installed)."""
    from transformers import AutoModelForCausalLM

    if kernels == "fla":
        if not gated_delta.fla_installed():
            pytest.skip("flash-linear-attention is not installed")
        monkeypatch.setattr(gated_delta, "USE_FLA", True)
    assert gated_delta.fla_usable(torch.empty(0, device="cuda")) == (kernels == "fla")
    path = tiny_model(family, logit_scale=4.0)
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    config = EngineConfig(device="cuda", dtype="float32", max_model_len=128, block_size=4)
    engine = LLMEngine(path, config)
    assert not engine.eager and engine.async_scheduling  # CUDA graphs and steps launched ahead
    outputs = [out.outputs[0] for out in engine.generate(PROMPTS, params)]
    if kernels == "torch":
        cpu = LLMEngine(path, cpu_config(max_model_len=128, block_size=4))
        want = [out.outputs[0] for out in cpu.generate(PROMPTS, params)]
        assert [o.token_ids for o in outputs] == [w.token_ids for w in want]
        for got, ref in zip(outputs, want, strict=True):
            torch.testing.assert_close(
                torch.tensor(got.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0
            )
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
        for prompt, sample in zip(PROMPTS, outputs, strict=True):
            assert_close_to_tf32(sample.logprobs, cuda_logprobs(hf, prompt, sample.token_ids), family)
    # bfloat16 (the dtype of real runs) with n samples, chunked prefill and sleep/wake runs.
    bf16 = LLMEngine(path, EngineConfig(device="cuda", max_model_len=128, enable_chunked_prefill=True,
                                        max_num_batched_tokens=16))  # fmt: skip
    sampled = SamplingParams(temperature=1.0, max_new_tokens=16, n=4, seed=0, ignore_eos=True)
    first = bf16.generate(PROMPTS, sampled)
    bf16.sleep(level=2)
    bf16.wake_up()
    again = bf16.generate(PROMPTS, sampled)
    assert [[s.token_ids for s in o.outputs] for o in first] == [
        [s.token_ids for s in o.outputs] for o in again
    ]


def _fields(out) -> list:
    return [(s.token_ids, s.logprobs, s.finish_reason, s.stop_reason) for s in out.outputs]


def _drive(engine: LLMEngine) -> list:
    """Requests joining while others decode and finishing at different steps (stop ids, lengths, an abort);
    every step's finished outputs."""
    log, ids = [], []
    sampled = SamplingParams(temperature=1.0, max_new_tokens=24, seed=5, n=3, stop_token_ids=range(300, 340))
    ids.append(engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=30)))
    ids.append(engine.add_request(PROMPTS[2], sampled))
    for step in range(40):
        if step == 3:
            ids.append(
                engine.add_request(PROMPTS[1], SamplingParams(temperature=0.7, max_new_tokens=9, seed=1))
            )
        if step == 6:
            ids.append(
                engine.add_request(
                    PROMPTS[3], SamplingParams(temperature=1.0, max_new_tokens=20, seed=2, n=2)
                )
            )
        if step == 9:
            log.append(engine.abort(ids[0]))
        log.append([_fields(o) for o in engine.step() if o.finished])
    while engine.has_unfinished():
        log.append([_fields(o) for o in engine.step() if o.finished])
    return log


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text"])
@pytest.mark.parametrize("kernels", ["torch", "fla"])
def test_cuda_graphs_and_async_scheduling_match_eager_and_transformers(
    family, kernels, tiny_model, monkeypatch
):
    """float32 on CUDA: the engine with CUDA graphs and async scheduling (states double buffered) gives the
    eager synchronous engine's greedy tokens and transformers' greedy completions; with n samples and
    requests joining and finishing mid-decode, the graphs' synchronous loop's outputs bit for bit."""
    from transformers import AutoModelForCausalLM

    if kernels == "fla":
        if not gated_delta.fla_installed():
            pytest.skip("flash-linear-attention is not installed")
        monkeypatch.setattr(gated_delta, "USE_FLA", True)
    path = tiny_model(family, logit_scale=4.0)
    base = dict(device="cuda", dtype="float32", max_model_len=128, block_size=4, max_num_seqs=16)
    eager = LLMEngine(path, EngineConfig(enforce_eager=True, async_scheduling=False, **base))
    graphs = LLMEngine(path, EngineConfig(async_scheduling=False, **base))
    fast = LLMEngine(path, EngineConfig(async_scheduling=True, **base))
    fast.ahead_policy.max_miss_rate = 1.0
    assert eager.runner.graphs is None and graphs.runner.graphs is not None
    assert fast.runner.graphs is not None and fast.async_scheduling and fast.runner.states.double

    greedy = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    want = [o.outputs[0] for o in eager.generate(PROMPTS, greedy)]
    for engine in (graphs, fast):
        got = [o.outputs[0] for o in engine.generate(PROMPTS, greedy)]
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4, rtol=0)
        assert engine.runner.graphs.graphs  # decode replayed captured graphs
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
    for prompt, sample in zip(PROMPTS, want, strict=True):
        ids = torch.tensor([prompt], device="cuda")
        ref = hf.generate(ids, do_sample=False, max_new_tokens=16)[0, len(prompt) :].tolist()
        if not gated_delta.fla_installed():  # transformers stops at eos: compare up to there
            assert sample.token_ids[: len(ref)] == ref
        else:  # transformers runs fla's kernels, whose float32 dots run in TF32: its log-probs, to that noise
            assert_close_to_tf32(sample.logprobs, cuda_logprobs(hf, prompt, sample.token_ids), family)

    # n samples (a shared prefill, copied states), stops at different steps (steps launched ahead and
    # discarded while the other samples go on), top log-probs: the eager engine's tokens, and the graphs'
    # synchronous loop's outputs bit for bit.
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=20, seed=1, n=4, stop_token_ids=range(300, 360)),
        SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=13, seed=2, n=2, logprobs=2),
        SamplingParams(temperature=0.0, max_new_tokens=25),
        SamplingParams(temperature=1.0, max_new_tokens=6, seed=3, n=3),
    ]
    outs = [engine.generate(PROMPTS, params) for engine in (eager, graphs, fast)]
    tokens = [[[s.token_ids for s in o.outputs] for o in out] for out in outs]
    assert tokens[0] == tokens[1] == tokens[2]
    assert [_fields(o) for o in outs[1]] == [_fields(o) for o in outs[2]]
    assert 0 < fast.ahead_stats.used < fast.ahead_stats.launched
    # Continuous batching through the step API.
    assert _drive(fast) == _drive(graphs)
    assert fast.block_manager.state_slots.num_free == 16 and not fast.has_unfinished()


@pytest.mark.parametrize("mode", ["in_place", "double"])
@pytest.mark.parametrize("k_heads, v_heads", [(16, 16), (16, 32)])  # Qwen3.5-0.8B's and -9B's heads
def test_fused_decode_kernel_matches_the_torch_rule_at_real_shapes(k_heads, v_heads, mode):
    """tidal's gated-delta decode kernel (``kernels/gated_delta_decode.py``, the engine's CUDA default) at
    batch 256, bfloat16 inputs and float32 states, against the torch decode path over chained steps; 6
    padding rows on the scratch slot; the slots only read stay bit for bit."""
    from tests.rollout.test_gated_delta_decode import step_inputs, torch_step
    from tidal.rollout.kernels.gated_delta_decode import gated_delta_decode

    gen = torch.Generator().manual_seed(v_heads)
    rows, seqs, dim = 256, 250, 128
    per_seq = 2 if mode == "double" else 1
    scratch = seqs * per_seq
    state = (torch.randn(scratch + 2, v_heads, dim, dim, generator=gen) * 0.3).cuda()  # and a spare
    want = state.clone()
    current = torch.arange(seqs, device="cuda") * per_seq
    pad = torch.full((rows - seqs,), scratch, device="cuda")
    for _ in range(3):
        other = current ^ 1 if mode == "double" else current
        reads, writes = torch.cat((current, pad)), torch.cat((other, pad))
        mixed, g, beta = (x.cuda() for x in step_inputs(rows, k_heads, v_heads, dim, dim, gen))
        mixed, beta = mixed.bfloat16(), beta.bfloat16()
        before = state.clone()
        out = gated_delta_decode(mixed, g, beta, state, reads.int(), writes.int(), k_heads)
        want_out, want = torch_step(mixed, g, beta, want, reads, writes, k_heads, dim, dim)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out[:seqs].float(), want_out[:seqs].float(), atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(state[other], want[other], atol=1e-4, rtol=1e-4)
        untouched = torch.ones(state.shape[0], dtype=torch.bool, device="cuda")
        untouched[other], untouched[scratch] = False, False
        assert torch.equal(state[untouched], before[untouched])
        want[scratch] = state[scratch]  # padding rows race on the scratch slot
        current = other


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_conv_update_matches_the_torch_conv_step(dtype):
    """``causal_conv_decode`` at Qwen3.5-9B's 8192 channels, batch 256 double buffered with padding rows:
    the torch path's conv outputs (conv1d's rounding; a bf16 ulp apart at most) and the histories bit for bit
    (the read slots' too)."""
    from tidal.rollout.kernels.gated_delta_decode import causal_conv_decode

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, seqs, channels, width = 256, 250, 8192, 4
    conv = torch.randn(2 * seqs + 1, channels, width - 1, generator=gen, device="cuda").to(dtype)
    weight = torch.randn(channels, 1, width, generator=gen, device="cuda").to(dtype)
    pad = torch.full((rows - seqs,), 2 * seqs, device="cuda")
    reads = torch.cat((torch.arange(seqs, device="cuda") * 2, pad))
    writes = torch.cat((torch.arange(seqs, device="cuda") * 2 + 1, pad))
    x = torch.randn(rows, channels + 64, generator=gen, device="cuda").to(dtype)[:, :channels]
    want_conv = conv.clone()
    window = torch.cat((want_conv.index_select(0, reads), x[:, :, None]), dim=-1)
    want = gated_delta.causal_conv(window[..., -1:], window[..., :-1], weight)[..., 0]
    want_conv.index_copy_(0, writes, window[..., 1:])
    out = causal_conv_decode(x, conv, weight, reads, writes)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:seqs].float(), want[:seqs].float(), atol=tol, rtol=tol)
    # every slot but the scratch one, which the padding rows race on
    torch.testing.assert_close(conv[: 2 * seqs], want_conv[: 2 * seqs], atol=0, rtol=0)


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_engine_on_the_fused_decode_kernel_matches_the_eager_torch_engine(family, tiny_model, monkeypatch):
    """float32: the engine with CUDA graphs and async scheduling (states double buffered), decoding through
    the fused kernel, gives the eager synchronous engine's greedy tokens and log-probs with the torch rule
    (``TIDAL_GDN_KERNEL=0``'s path), n samples included."""
    monkeypatch.setattr(gated_delta, "USE_FLA", False)
    path = tiny_model(family, logit_scale=4.0)
    base = dict(device="cuda", dtype="float32", max_model_len=128, block_size=4, max_num_seqs=16)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=16, seed=3, n=3, ignore_eos=True)
    monkeypatch.setattr(gated_delta, "USE_DECODE_KERNEL", False)
    assert gated_delta.decode_path(torch.empty(0, device="cuda")) == "torch"
    eager = LLMEngine(path, EngineConfig(enforce_eager=True, async_scheduling=False, **base))
    want = [eager.generate(PROMPTS, params) for params in (greedy, sampled)]
    monkeypatch.setattr(gated_delta, "USE_DECODE_KERNEL", True)
    assert gated_delta.decode_path(torch.empty(0, device="cuda")) == "triton"
    fast = LLMEngine(path, EngineConfig(async_scheduling=True, **base))  # graphs captured on the kernel
    assert fast.runner.graphs is not None and fast.async_scheduling and fast.runner.states.double
    got = [fast.generate(PROMPTS, params) for params in (greedy, sampled)]
    assert fast.runner.graphs.graphs
    for outs, refs in zip(got, want, strict=True):
        assert [[s.token_ids for s in o.outputs] for o in outs] == [
            [s.token_ids for s in o.outputs] for o in refs
        ]
        for o, r in zip(outs, refs, strict=True):
            for s, w in zip(o.outputs, r.outputs, strict=True):
                torch.testing.assert_close(
                    torch.tensor(s.logprobs), torch.tensor(w.logprobs), atol=1e-4, rtol=0
                )
