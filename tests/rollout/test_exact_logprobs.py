"""Exact log-probs (``EngineConfig.exact_logprobs`` / ``--exact_logprobs``, CPU float32): the engine's
sampled-token log-probs equal the trainer's forward bit for bit, whatever the batch and whether a token
came from prefill or decode; the batch-invariant ops underneath; the GRPO step that skips its forward."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tidal.models.forward import token_logprobs
from tidal.rollout import EngineConfig, LLMEngine
from tidal.rollout import batch_invariant as bi
from tidal.rollout.sampling_params import SamplingParams

TEMPERATURE = 0.8


def _engine(path, exact=True):
    config = EngineConfig(device="cpu", max_model_len=128, num_kv_blocks=64, exact_logprobs=exact)
    return LLMEngine(path, config)


def _rollout(vocab=512, n=8, seed=0):
    """GRPO-like requests: prompts and response budgets of mixed lengths, each sample its own seed."""
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(3, vocab, (int(k),), generator=g).tolist()
        for k in torch.randint(2, 30, (n,), generator=g)
    ]
    params = [
        SamplingParams(temperature=TEMPERATURE, max_tokens=int(m), seed=i, ignore_eos=True)
        for i, m in enumerate(torch.randint(1, 20, (n,), generator=g))
    ]  # fmt: skip
    return prompts, params


def bf16_engine_and_master_policy(path):
    """The CUDA dtype path on the CPU: a bf16 exact engine's rollout (prompts, outputs) of ``path`` and a
    float32 master policy of it made exact in bf16 (to run under bf16 autocast)."""
    prompts, params = _rollout(n=6, seed=2)
    config = EngineConfig(
        device="cpu", dtype="bfloat16", max_model_len=64, num_kv_blocks=32, exact_logprobs=True
    )
    outputs = LLMEngine(path, config).generate(prompts, params)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    bi.make_exact(hf, compute_dtype=torch.bfloat16)
    return prompts, outputs, hf


def _trainer_logprobs(hf, prompts, outputs, packed: bool) -> list[torch.Tensor]:
    """The trainer's per-token log-probs of each response (packed: one row; else right-padded rows)."""
    rows = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs, strict=True)]
    lengths = torch.tensor([len(r) for r in rows])
    if packed:
        batch = {
            "input_ids": torch.tensor([t for r in rows for t in r])[None],
            "position_ids": torch.cat([torch.arange(n) for n in lengths.tolist()])[None],
            "segment_ids": torch.repeat_interleave(torch.arange(len(rows)), lengths)[None],
        }
    else:
        width = int(lengths.max())
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
        batch = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    with torch.no_grad():
        lp = token_logprobs(hf, batch, TEMPERATURE)[0]
    out, offset = [], 0
    for i, (p, r) in enumerate(zip(prompts, rows, strict=True)):
        if packed:
            out.append(lp[0, offset + len(p) : offset + len(r)])
            offset += len(r)
        else:
            out.append(lp[i, len(p) : len(r)])
    return out


def _max_gap(engine_outputs, trainer: list[torch.Tensor]) -> float:
    return max(
        (torch.tensor(o.outputs[0].logprobs) - t).abs().max().item()
        for o, t in zip(engine_outputs, trainer, strict=True)
    )


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("llama", {}),
        ("qwen3", {}),
        ("mistral", {"sliding_window": 8}),
        # MoE: routing, the experts' GEMMs and the slot-ordered sum of the k outputs (bi.moe_*)
        ("qwen3_moe", {}),
        ("mixtral", {}),
        ("qwen2_moe", {}),  # + the gated shared expert (a one-column gate: bi.gate_column)
    ],
)
def test_engine_and_trainer_logprobs_are_bit_identical(tiny_model, family, overrides):
    path = tiny_model(family, logit_scale=4.0, **overrides)
    prompts, params = _rollout()
    outputs = _engine(path).generate(prompts, params)
    hf = bi.make_exact(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval())
    assert _max_gap(outputs, _trainer_logprobs(hf, prompts, outputs, packed=True)) == 0.0
    assert _max_gap(outputs, _trainer_logprobs(hf, prompts, outputs, packed=False)) == 0.0


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_default_mode_is_not_exact(tiny_model, family):
    """Without the mode the same comparison is off by float32 rounding (recorded in docs/algorithms.md)."""
    path = tiny_model(family, logit_scale=4.0)
    prompts, params = _rollout()
    outputs = _engine(path, exact=False).generate(prompts, params)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert 0.0 < _max_gap(outputs, _trainer_logprobs(hf, prompts, outputs, packed=True)) < 1e-3


def test_a_request_alone_and_in_a_larger_batch_gets_identical_logprobs(tiny_model):
    path = tiny_model("llama", logit_scale=4.0)
    engine = _engine(path)
    assert_alone_as_in_the_batch(engine, *_rollout(n=12, seed=1), picks=(0, 5, 11))


def assert_alone_as_in_the_batch(engine, prompts, params, picks) -> None:
    """The requests ``picks`` generated alone get the tokens and log-probs they got in the whole batch."""
    together = engine.generate(prompts, params)
    for i in picks:
        alone = engine.generate([prompts[i]], [params[i]])[0].outputs[0]
        assert alone.token_ids == together[i].outputs[0].token_ids
        assert alone.logprobs == together[i].outputs[0].logprobs


def test_decode_and_prefill_of_the_same_tokens_agree(tiny_model):
    """Greedy decoding, then each prefix prefilled: the prefill's first token and its log-prob are the
    decode's, bit for bit."""
    path = tiny_model("llama", logit_scale=4.0)
    engine = _engine(path)
    prompt = list(range(5, 25))
    decoded = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    tokens, logprobs = decoded[0].outputs[0].token_ids, decoded[0].outputs[0].logprobs
    prefixes = [prompt + tokens[:k] for k in (3, 7, 11)]
    prefilled = engine.generate(prefixes, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    for k, out in zip((3, 7, 11), prefilled, strict=True):
        assert out.outputs[0].token_ids == [tokens[k]]
        assert out.outputs[0].logprobs == [logprobs[k]]


def test_prefix_caching_and_chunked_prefill_keep_the_exact_logprobs(tiny_model):
    """Prefill with context (cached prefix, prompt chunks) reads its keys from the paged cache: the same
    log-probs as the plain exact engine's."""
    path = tiny_model("llama", logit_scale=4.0)
    shared = list(range(3, 40))
    prompts = [shared + [100 + i] * (i + 1) for i in range(6)]
    params = [
        SamplingParams(temperature=TEMPERATURE, max_tokens=6, seed=i, ignore_eos=True) for i in range(6)
    ]
    plain = _engine(path).generate(prompts, params)
    config = EngineConfig(
        device="cpu", max_model_len=128, num_kv_blocks=64, exact_logprobs=True, enable_prefix_caching=True,
        enable_chunked_prefill=True, max_num_batched_tokens=24,
    )  # fmt: skip
    engine = LLMEngine(path, config)
    engine.generate(prompts[:1], params[:1])  # caches the shared prefix
    for a, b in zip(plain, engine.generate(prompts, params), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_linear_rows_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    weight, x = torch.randn(320, 192), torch.randn(37, 192)
    full = bi.linear(x, weight)
    for start, stop in ((0, 1), (5, 6), (3, 20), (36, 37), (0, 32), (16, 32)):  # whole blocks: a view
        assert torch.equal(bi.linear(x[start:stop], weight), full[start:stop])
    # separate parts of a packed projection equal the packed product's columns
    assert torch.equal(bi.linear(x, weight[:64]), full[:, :64])


def test_attention_does_not_depend_on_other_queries_or_extra_keys():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 21, 4, 8), torch.randn(3, 40, 2, 8), torch.randn(3, 40, 2, 8)
    pos = torch.arange(21).expand(3, 21)
    full = bi.attention(q, k, v, pos, 0.35)
    # query 13 of row 1 alone, against only its 14 keys (garbage beyond them must not matter either)
    alone = bi.attention(q[1:2, 13:14], k[1:2, :14], v[1:2, :14], torch.tensor([[13]]), 0.35)
    assert torch.equal(alone, full[1:2, 13:14])
    junk_k = k.clone()
    junk_k[:, 30:] = 1e3
    assert torch.equal(bi.attention(q, junk_k, v, pos, 0.35), full)


@pytest.mark.parametrize("heads,kv_heads,window", [(4, 4, None), (6, 2, 5), (40, 2, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_query_attention_equals_the_same_query_in_a_prefill(heads, kv_heads, window, dtype):
    # a decode step's layout (the query heads of a KV head as GEMM rows; 40 / 2: two row blocks)
    torch.manual_seed(0)
    q = torch.randn(2, 35, heads, 8).to(dtype)
    k, v = (torch.randn(2, 35, kv_heads, 8).to(dtype) for _ in range(2))
    full = bi.attention(q, k, v, torch.arange(35).expand(2, 35), 0.35, window)
    for pos in (0, 15, 16, 34):
        one = bi.attention(q[:, pos : pos + 1], k, v, torch.tensor([[pos], [pos]]), 0.35, window)
        assert torch.equal(one, full[:, pos : pos + 1])


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_bf16_engine_and_float32_master_trainer_are_bit_identical(tiny_model, family):
    """The CUDA dtype path on the CPU: a bf16 engine, a float32 master policy under bf16 autocast computing
    in bf16; Qwen routers round the routing weights to bf16, Mixtral's stay float32 (both sides alike)."""
    from tidal.models.precision import Precision

    prompts, outputs, hf = bf16_engine_and_master_policy(tiny_model(family, logit_scale=4.0))
    with Precision.create("bf16", torch.device("cpu")).autocast():
        assert _max_gap(outputs, _trainer_logprobs(hf, prompts, outputs, packed=True)) == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_cuda_bf16_moe_engine_and_trainer_logprobs_are_bit_identical(tiny_model, family):
    """Whether exact MoE holds on CUDA (bf16 engine vs a float32 master policy under bf16 autocast): the
    routing sums by halving and picks by a stable sort, the experts' GEMMs are the fixed-tile kernels."""
    from tidal.models.precision import Precision

    assert family in bi.EXACT_CUDA_MODEL_TYPES  # measured exact on an H200, so not refused on CUDA
    path = tiny_model(family, logit_scale=4.0)
    prompts, params = _rollout()
    config = EngineConfig(device="cuda", max_model_len=128, num_kv_blocks=64, exact_logprobs=True)
    engine = LLMEngine(path, config)
    outputs = engine.generate(prompts, params)
    engine.close()
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
    bi.make_exact(hf)  # computes in bf16, the engine's dtype on CUDA
    rows = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs, strict=True)]
    batch = {
        "input_ids": torch.tensor([t for r in rows for t in r], device="cuda")[None],
        "position_ids": torch.cat([torch.arange(len(r)) for r in rows])[None].cuda(),
    }
    with torch.no_grad(), Precision.create("bf16", torch.device("cuda")).autocast():
        lp = token_logprobs(hf, batch, TEMPERATURE)[0][0].float().cpu()
    gap, offset = 0.0, 0
    for p, r, o in zip(prompts, rows, outputs, strict=True):
        gap = max(
            gap, (torch.tensor(o.outputs[0].logprobs) - lp[offset + len(p) : offset + len(r)]).abs().max()
        )
        offset += len(r)
    print(f"{family} cuda bf16 exact max |engine - trainer|: {float(gap)}")
    assert gap == 0.0


def test_moe_ops_do_not_depend_on_the_batch():
    """A token's routed-experts output (and the one-column shared-expert gate) alone equals its row in
    a batch whose other tokens share its experts or not."""
    torch.manual_seed(0)
    x, router = torch.randn(37, 24), torch.randn(6, 24)
    gate_up, down = torch.randn(6, 2 * 10, 24), torch.randn(6, 24, 10)
    _, weights, ids = bi.moe_route(x, router, 2, True, None)
    full = bi.moe_experts(x, gate_up, down, ids, weights, torch.nn.functional.silu)
    gate = torch.randn(1, 24)
    for start, stop in ((0, 1), (5, 6), (3, 20), (36, 37), (0, 32), (16, 32)):  # whole blocks: a view
        _, w, i = bi.moe_route(x[start:stop], router, 2, True, None)
        assert torch.equal(i, ids[start:stop]) and torch.equal(w, weights[start:stop])
        alone = bi.moe_experts(x[start:stop], gate_up, down, i, w, torch.nn.functional.silu)
        assert torch.equal(alone, full[start:stop])
        assert torch.equal(bi.gate_column(x[start:stop], gate), bi.gate_column(x, gate)[start:stop])
    # ties go to the lower expert id, whatever the batch (a stable sort)
    _, weights, ids = bi.moe_route(x, torch.zeros(6, 24), 2, False, None)
    assert torch.equal(ids, torch.tensor([[0, 1]]).expand(37, 2)) and torch.all(weights == 1 / 6)


def test_exact_mode_refuses_what_it_does_not_cover(tiny_model):
    with pytest.raises(ValueError, match="tp_size 1"):
        EngineConfig(exact_logprobs=True, tp_size=2)
    with pytest.raises(ValueError, match="gemma2"):
        _engine(tiny_model("gemma2"))
    # the engine's router has no noise; the trainer's (tidal ppo checks the HF config before loading)
    jitter = AutoConfig.from_pretrained(tiny_model("mixtral", router_jitter_noise=0.1))
    assert "router_jitter_noise" in bi.exact_problem(jitter)


def skipped_forward(trainer, out) -> tuple[torch.Tensor, torch.Tensor]:
    """The old-log-prob forward that ``--exact_logprobs`` skips, run anyway on a step's experience ``out`` by
    the ``trainer``'s actor (its scoring shape, temperature and precision): the log-probs of the sampled
    tokens and the action mask."""
    from tidal.experience.maker import forward_logprobs

    micro, packing, _ = trainer._scoring_shape()
    actor = trainer.parts.actor
    lp = forward_logprobs(actor.model, out, micro, packing, trainer.run.rollout.temperature, actor.precision)
    return lp, out.action_mask.bool()


def test_grpo_step_skips_the_old_logprob_forward(tiny_qwen2, tmp_path, monkeypatch):
    from tidal.cli.train_ppo import parse_run
    from tidal.trainers.ppo import run_ppo
    from tidal.trainers.ppo import trainer as trainer_module

    with (tmp_path / "prompts.jsonl").open("w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"{i % 10}>", "label": str(i % 10)}) + "\n")
    checked = []

    def no_forward(*args, **kwargs):
        raise AssertionError("--exact_logprobs ran the old-log-prob forward")

    real = trainer_module.PPOTrainer.make_experience

    def make_experience(self, exp):
        out, stats = real(self, exp)
        lp, mask = skipped_forward(self, out)  # gives exactly the engine's log-probs on every action token
        checked.append(mask.sum().item())
        assert torch.equal(lp[mask], out.rollout_logprobs[mask])
        assert out.old_logprobs is None  # one on-policy step: the update's forward gives them
        return out, stats

    monkeypatch.setattr(trainer_module, "forward_logprobs", no_forward)
    monkeypatch.setattr(trainer_module.PPOTrainer, "make_experience", make_experience)
    history = run_ppo(parse_run([
        "--pretrain", str(tiny_qwen2), "--prompt_data", str(tmp_path / "prompts.jsonl"), "--input_key", "prompt",
        "--label_key", "label", "--remote_rm_url", str(_reward_func()), "--advantage_estimator", "group_norm",
        "--n_samples_per_prompt", "4", "--rollout_batch_size", "4", "--train_batch_size", "16",
        "--micro_train_batch_size", "8", "--micro_rollout_batch_size", "8", "--generate_max_len", "6",
        "--prompt_max_len", "8", "--init_kl_coef", "0", "--save_path", str(tmp_path / "final"),
        "--seed", "3", "--max_samples", "8", "--packing_samples", "--exact_logprobs",
    ]))  # fmt: skip
    assert len(history) == 2 and len(checked) == 2 and min(checked) > 0
    # measured by the update's loss forward (grad enabled: the spliced log-probs), not old = rollout
    assert all(h["rollout/logprob_mismatch"] == 0.0 for h in history)
    assert all(h["policy/approx_kl"] == 0.0 and h["policy/clip_ratio"] == 0.0 for h in history)


def _reward_func():
    from pathlib import Path

    return Path(__file__).resolve().parents[2] / "examples" / "reward_func.py"


@pytest.mark.parametrize(
    ("family", "extra", "message"),
    [
        ("gemma2", [], "--exact_logprobs supports"),
        ("qwen2", ["--lora_rank", "4", "--lora_dropout", "0.1"], "--lora_dropout 0"),
        ("qwen2", ["--lora_rank", "4", "--load_in_4bit"], "4-bit base"),
        ("qwen2", ["--vllm_tensor_parallel_size", "2"], "--vllm_tensor_parallel_size 1"),
    ],
)
def test_tidal_ppo_refuses_uncovered_setups_in_one_line(tiny_model, tmp_path, capsys, family, extra, message):
    assert message in _refusal(tiny_model(family), tmp_path, capsys, extra)


def _refusal(policy, tmp_path, capsys, extra: list[str]) -> str:
    """``tidal ppo --exact_logprobs *extra`` on ``policy``: it must exit 2 with no traceback; its stderr."""
    from tidal.cli.train_ppo import main as ppo_main

    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "1>", "label": "1"}) + "\n")
    flags = [
        "--pretrain", str(policy), "--prompt_data", str(tmp_path / "prompts.jsonl"), "--input_key", "prompt",
        "--remote_rm_url", str(_reward_func()), "--save_path", str(tmp_path / "out"), "--exact_logprobs", *extra,
    ]  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        ppo_main(flags)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err
