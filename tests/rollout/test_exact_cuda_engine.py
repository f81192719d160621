"""``--exact_logprobs`` on CUDA, end to end: the engine's sampled-token log-probs in bf16 (and float32) against
the trainer's exact forward (a float32 master model under bf16 autocast, as ``tidal ppo`` runs it): max |diff|
== 0, and the gap without the mode, printed; a request alone or in a larger batch, the exact forward's
gradients, ``torch.compile`` and a GRPO step that takes the engine's log-probs. The kernels themselves, at
7B / 0.5B shapes against float64, are in ``test_exact_cuda.py``; all of these are ``gpu`` tests.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.rollout.test_exact_cuda import TEMPERATURE
from tests.rollout.test_exact_logprobs import (
    _rollout,
    assert_alone_as_in_the_batch,
    bf16_engine_and_master_policy,
    skipped_forward,
)
from tidal.rollout import batch_invariant as bi


def _trainer_gaps(hf, prompts, outputs, device, precision=None) -> float:
    """max |engine - trainer| over the responses, the trainer scoring one packed row."""
    from tidal.models.forward import token_logprobs

    rows = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs, strict=True)]
    lengths = [len(r) for r in rows]
    batch = {
        "input_ids": torch.tensor([t for r in rows for t in r], device=device)[None],
        "position_ids": torch.cat([torch.arange(n, device=device) for n in lengths])[None],
        "segment_ids": torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lengths))[None].to(
            device
        ),
    }
    with torch.no_grad(), precision.autocast() if precision else contextlib.nullcontext():
        lp = token_logprobs(hf, batch, TEMPERATURE)[0][0].float().cpu()
    gap, offset = 0.0, 0
    for p, r, o in zip(prompts, rows, outputs, strict=True):
        trainer = lp[offset + len(p) : offset + len(r)]
        gap = max(gap, (torch.tensor(o.outputs[0].logprobs) - trainer).abs().max().item())
        offset += len(r)
    return gap


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("family", "overrides"), [("qwen2", {}), ("llama", {}), ("qwen3", {}), ("mistral", {"sliding_window": 8})]
)
def test_cuda_bf16_engine_and_trainer_logprobs_are_bit_identical(tiny_model, family, overrides):
    """The engine in bf16 (CUDA graphs on) against the trainer's float32 master model under bf16 autocast:
    exact mode gives 0; without it the gap is printed (and is not 0)."""
    from transformers import AutoModelForCausalLM

    from tidal.models.precision import Precision
    from tidal.rollout import EngineConfig, LLMEngine

    path = tiny_model(family, logit_scale=4.0, **overrides)
    prompts, params = _rollout()
    device = torch.device("cuda")
    precision = Precision.create("bf16", device)
    gaps = {}
    for exact in (False, True):
        config = EngineConfig(device="cuda", max_model_len=128, num_kv_blocks=64, exact_logprobs=exact)
        engine = LLMEngine(path, config)
        assert engine.dtype == torch.bfloat16
        outputs = engine.generate(prompts, params)
        engine.close()
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
        if exact:
            bi.make_exact(hf)  # computes in bf16, the engine's dtype on CUDA
        gaps[exact] = _trainer_gaps(hf, prompts, outputs, device, precision)
    print(f"{family} cuda bf16 max |engine - trainer|: without the mode {gaps[False]:.3g}, with {gaps[True]}")
    assert gaps[True] == 0.0
    assert gaps[False] > 0.0


@pytest.mark.gpu
def test_cuda_exact_trainer_under_torch_compile_keeps_the_engines_bits(tiny_model):
    """``--exact_logprobs --torch_compile``: with the trainer's blocks compiled (``compile_blocks``) the exact
    forward runs them eagerly (inductor's fusion of the elementwise ops between the exact kernels rounds
    once where eager rounds after each op: the session-14 failure) and gives the engine's log-probs bit for
    bit, with grad enabled too, where the default forward that gives the gradient runs compiled."""
    import torch._dynamo.utils as dynamo_utils
    from transformers import AutoModelForCausalLM

    from tidal.models.compile import compile_blocks
    from tidal.models.forward import token_logprobs
    from tidal.models.precision import Precision
    from tidal.rollout import EngineConfig, LLMEngine

    path = tiny_model("qwen2", logit_scale=4.0)
    prompts, params = _rollout()
    device = torch.device("cuda")
    config = EngineConfig(device="cuda", max_model_len=128, num_kv_blocks=64, exact_logprobs=True)
    engine = LLMEngine(path, config)
    outputs = engine.generate(prompts, params)
    engine.close()
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
    bi.make_exact(hf)
    assert compile_blocks(hf) > 0
    precision = Precision.create("bf16", device)
    assert _trainer_gaps(hf, prompts, outputs, device, precision) == 0.0
    dynamo_utils.counters.clear()
    rows = [prompts[i] + list(outputs[i].outputs[0].token_ids) for i in range(2)]  # two, packed
    ids = torch.tensor([rows[0] + rows[1]], device=device)
    positions = torch.cat([torch.arange(len(row), device=device) for row in rows])[None]
    batch = {"input_ids": ids, "position_ids": positions, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad(), precision.autocast():
        values = token_logprobs(hf, batch, TEMPERATURE)[0]
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 0  # the exact forward: eager
    with precision.autocast():
        spliced = token_logprobs(hf, batch, TEMPERATURE)[0]
    spliced.sum().backward()
    assert torch.equal(spliced.detach(), values)
    assert dynamo_utils.counters["stats"]["unique_graphs"] > 0  # the default forward: compiled


@pytest.mark.gpu
def test_cuda_float32_engine_and_trainer_logprobs_are_bit_identical(tiny_model):
    from transformers import AutoModelForCausalLM

    from tidal.rollout import EngineConfig, LLMEngine

    path = tiny_model("qwen2", logit_scale=4.0)
    prompts, params = _rollout(seed=4)
    config = EngineConfig(
        device="cuda", dtype="float32", max_model_len=128, num_kv_blocks=64, exact_logprobs=True
    )
    outputs = LLMEngine(path, config).generate(prompts, params)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
    bi.make_exact(hf, compute_dtype=torch.float32)
    assert _trainer_gaps(hf, prompts, outputs, torch.device("cuda")) == 0.0


@pytest.mark.gpu
def test_cuda_request_alone_and_in_a_larger_batch_gets_identical_logprobs(tiny_model):
    from tidal.rollout import EngineConfig, LLMEngine

    engine = LLMEngine(
        tiny_model("qwen2", logit_scale=4.0),
        EngineConfig(device="cuda", max_model_len=128, num_kv_blocks=128, exact_logprobs=True),
    )
    assert_alone_as_in_the_batch(engine, *_rollout(n=40, seed=1), picks=(0, 17, 39))


@pytest.mark.gpu
def test_cuda_exact_forward_is_differentiable(tiny_model):
    """The policy loss backpropagates through the kernels (their backward is plain torch's)."""
    from transformers import AutoModelForCausalLM

    from tidal.models.forward import token_logprobs

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model("qwen2")), dtype=torch.float32).cuda()
    bi.make_exact(hf)
    ids = torch.randint(3, 500, (2, 24), device="cuda")
    positions = torch.arange(24, device="cuda").expand(2, 24)
    batch = {"input_ids": ids, "position_ids": positions, "attention_mask": torch.ones_like(ids)}
    token_logprobs(hf, batch, 1.0)[0][:, 1:].sum().backward()
    grads = [p.grad for p in hf.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert hf.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


@pytest.mark.gpu
def test_cuda_grpo_step_takes_the_engines_logprobs_and_they_equal_the_skipped_forward(
    tiny_qwen2, tmp_path, monkeypatch
):
    """``tidal ppo --exact_logprobs`` on CUDA (bf16 engine, float32 master policy under bf16 autocast): the
    step skips the old-log-prob forward, and that forward, run here anyway, gives the engine's log-probs."""
    import json
    from pathlib import Path

    from tidal.cli.train_ppo import parse_run
    from tidal.trainers.ppo import run_ppo
    from tidal.trainers.ppo import trainer as trainer_module

    with (tmp_path / "prompts.jsonl").open("w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"{i % 10}>", "label": str(i % 10)}) + "\n")
    checked = []
    real = trainer_module.PPOTrainer.make_experience

    def make_experience(self, exp):
        out, stats = real(self, exp)
        lp, mask = skipped_forward(self, out)
        assert lp.device.type == "cuda"
        # on-policy (one update per rollout): no old-log-prob pass at all; the engine's log-probs stand in
        assert out.old_logprobs is None
        checked.append((lp[mask] - out.rollout_logprobs[mask]).abs().max().item())
        return out, stats

    monkeypatch.setattr(trainer_module.PPOTrainer, "make_experience", make_experience)
    reward = Path(__file__).resolve().parents[2] / "examples" / "reward_func.py"
    history = run_ppo(parse_run([
        "--pretrain", str(tiny_qwen2), "--prompt_data", str(tmp_path / "prompts.jsonl"), "--input_key", "prompt",
        "--label_key", "label", "--remote_rm_url", str(reward), "--advantage_estimator", "group_norm",
        "--n_samples_per_prompt", "4", "--rollout_batch_size", "4", "--train_batch_size", "16",
        "--micro_train_batch_size", "8", "--micro_rollout_batch_size", "8", "--generate_max_len", "6",
        "--prompt_max_len", "8", "--init_kl_coef", "0", "--save_path", str(tmp_path / "final"),
        "--seed", "3", "--max_samples", "8", "--packing_samples", "--exact_logprobs", "--param_dtype", "bf16",
    ]))  # fmt: skip
    print(f"cuda GRPO exact: max |skipped forward - engine| per step {checked}")
    assert len(history) == 2 and checked == [0.0, 0.0]
    assert all(h["rollout/logprob_mismatch"] == 0.0 for h in history)


# ------------------------------------------------------------------------------------ cpu bf16
def test_cpu_bf16_engine_and_float32_master_trainer_under_autocast_are_bit_identical(tiny_model):
    """The dtype path the CUDA mode relies on, on the CPU's torch ops: the engine holds bf16 weights; the
    trainer holds float32 master weights and runs under bf16 autocast, and its exact forward computes what
    the engine does (embedding output in bf16, each weight rounded once, autocast off inside)."""
    from tidal.models.precision import Precision

    prompts, outputs, hf = bf16_engine_and_master_policy(tiny_model("qwen2", logit_scale=4.0))
    precision = Precision.create("bf16", torch.device("cpu"))
    assert _trainer_gaps(hf, prompts, outputs, torch.device("cpu"), precision) == 0.0


def test_trainer_takes_the_engines_rope_frequencies(tiny_model):
    """A policy built on CUDA gets transformers' ``inv_freq`` from CUDA's ``pow``, which may round an ulp
    away from the engine's (CPU) table: exact mode uses the engine's frequencies on both sides."""
    from transformers import AutoModelForCausalLM

    from tidal.rollout import EngineConfig, LLMEngine

    path = tiny_model("llama", logit_scale=4.0, num_hidden_layers=2)
    prompts, params = _rollout(n=4, seed=6)
    config = EngineConfig(device="cpu", max_model_len=64, num_kv_blocks=32, exact_logprobs=True)
    outputs = LLMEngine(path, config).generate(prompts, params)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    inv_freq = hf.model.rotary_emb.inv_freq
    inv_freq.copy_(torch.nextafter(inv_freq, torch.ones_like(inv_freq)))  # one ulp up, as another pow may
    bi.make_exact(hf)
    assert _trainer_gaps(hf, prompts, outputs, torch.device("cpu")) == 0.0


def test_exact_mode_on_cuda_names_the_families_it_covers():
    problem = bi.exact_device_problem(torch.device("cuda"), torch.bfloat16, "gemma2")
    assert problem.startswith("exact_logprobs on CUDA supports the llama, qwen2, qwen3, mistral, qwen3_moe, ")
    assert problem.endswith(" families, not 'gemma2'")
    moe = bi.exact_device_problem(torch.device("cuda"), torch.bfloat16, "qwen3_moe")
    assert moe in (None, "exact_logprobs on CUDA needs Triton installed")


def test_exact_mode_refuses_float16_in_one_line(tiny_model):
    from tidal.rollout import EngineConfig, LLMEngine

    config = EngineConfig(
        device="cpu", dtype="float16", max_model_len=64, num_kv_blocks=8, exact_logprobs=True
    )
    with pytest.raises(ValueError, match="float32 or bfloat16 on the CPU or CUDA, not cpu torch.float16"):
        LLMEngine(tiny_model("qwen2"), config)
