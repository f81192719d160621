"""Sampler math (truncation, Gumbel noise) and stop rules: stop strings, stop ids, min tokens, eos."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.rollout.reference import PROMPTS, cpu_config
from tidal.rollout import LLMEngine, SamplingParams
from tidal.rollout.runner.sampler import Sampler, SamplingTensors, truncate_logits, uniform_noise


def _tensors(rows: int, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, vocab=4) -> SamplingTensors:
    full = lambda v, dtype=torch.float32: torch.full((rows,), v, dtype=dtype)  # noqa: E731
    return SamplingTensors(
        all_greedy=temperature == 0,
        any_truncation=top_k > 0 or top_p < 1 or min_p > 0,
        temperatures=full(temperature),
        top_k=full(top_k if top_k > 0 else vocab, torch.int64),
        top_p=full(top_p),
        min_p=full(min_p),
        seeds=torch.arange(rows, dtype=torch.int64) * 7919,
        positions=torch.zeros(rows, dtype=torch.int64),
    )


def test_truncation_keeps_the_right_tokens():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(3, 1)
    out = truncate_logits(
        logits,
        top_k=torch.tensor([2, 4, 4]),
        top_p=torch.tensor([1.0, 0.7, 1.0]),
        min_p=torch.tensor([0.0, 0.0, 0.25]),
    )
    kept = torch.isfinite(out)
    # top-k 2 -> {0, 1}; top-p 0.7 -> 0.5 + 0.3 reaches it -> {0, 1}; min-p 0.25 -> p >= 0.125 -> {0, 1, 2}
    assert kept.tolist() == [
        [True, True, False, False],
        [True, True, False, False],
        [True, True, True, False],
    ]
    torch.testing.assert_close(out[kept], logits[kept])


def test_exact_sampler_draws_the_same_tokens_and_takes_the_exact_logprobs():
    """Exact mode's sampling pass computes no log-probs of its own (``reference(..., logprobs=False)``):
    the same tokens as the default sampler (greedy and sampled rows, top-p, a repetition penalty, a
    suppressed token) and ``exact_logprobs``' values."""
    from tidal.rollout.runner.sampler import exact_logprobs

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    st = _tensors(6, temperature=0.8, top_p=0.9, vocab=50)
    st.temperatures[0] = 0.0  # a greedy row among sampled ones
    st.penalty_rows, st.penalty_tokens, st.penalties = (
        torch.tensor([1, 2]),
        torch.tensor([3, 4]),
        torch.tensor([1.3, 1.3]),
    )
    st.suppress_rows, st.suppress_tokens = torch.tensor([3]), torch.tensor([7])
    for tensors in (st, _tensors(6, temperature=0, vocab=50)):
        tokens, logprobs = Sampler(exact=True)(logits, tensors)
        assert torch.equal(tokens, Sampler()(logits, tensors)[0])
        assert torch.equal(logprobs, exact_logprobs(logits, tokens, tensors))
        assert Sampler.reference(logits, tensors, logprobs=False)[1] is None


def test_gumbel_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    rows = 20000
    tokens, logprobs = Sampler()(probs.log().repeat(rows, 1), _tensors(rows))
    freq = torch.bincount(tokens, minlength=4).float() / rows
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)
    torch.testing.assert_close(logprobs, probs.log()[tokens])
    # With top-p 0.7 only the two most likely tokens can come out, renormalised to 5/8, 3/8.
    tokens, logprobs = Sampler()(probs.log().repeat(rows, 1), _tensors(rows, top_p=0.7))
    freq = torch.bincount(tokens, minlength=4).float() / rows
    torch.testing.assert_close(freq, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.015, rtol=0)
    torch.testing.assert_close(logprobs, probs.log()[tokens])  # log-probs before truncation


def test_noise_is_uniform_and_depends_on_seed_and_position():
    u = uniform_noise(torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0]), 50000)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    torch.testing.assert_close(uniform_noise(torch.tensor([1]), torch.tensor([1]), 50000)[0], u[1])


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(tiny_model("llama"), cpu_config(max_model_len=128, block_size=8))


@pytest.fixture(scope="module")
def greedy_ref(engine):
    """Greedy output of PROMPTS[1] without any stop rule."""
    return engine.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True))[
        0
    ]


def test_top_k_one_is_greedy(engine, greedy_ref):
    params = SamplingParams(temperature=1.3, top_k=1, max_new_tokens=40, ignore_eos=True, seed=5)
    assert engine.generate([PROMPTS[1]], params)[0].outputs[0].token_ids == greedy_ref.outputs[0].token_ids


def test_stop_string_cuts_text_before_it(engine, greedy_ref):
    full_ids, full_text = greedy_ref.outputs[0].token_ids, greedy_ref.outputs[0].text
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    assert stop.strip(), "the greedy text should have a usable middle"
    out = engine.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_new_tokens=40, stop=[stop]))[
        0
    ].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full_text[: full_text.find(stop)]
    # Token ids keep what was sampled, up to the token that completed the stop string, and no further.
    assert out.token_ids == full_ids[: len(out.token_ids)]
    assert stop in engine.tokenizer.decode(out.token_ids) and stop not in engine.tokenizer.decode(
        out.token_ids[:-1]
    )
    keep = SamplingParams(temperature=0.0, max_new_tokens=40, stop=stop, include_stop_str_in_output=True)
    assert engine.generate([PROMPTS[1]], keep)[0].outputs[0].text == full_text[: full_text.find(stop)] + stop


def test_stop_token_ids_and_min_new_tokens(engine, greedy_ref):
    full = greedy_ref.outputs[0].token_ids
    stop_id = full[4]
    first = full.index(stop_id)
    out = engine.generate(
        [PROMPTS[1]], SamplingParams(temperature=0.0, max_new_tokens=40, stop_token_ids=[stop_id])
    )
    out = out[0].outputs[0]
    assert out.token_ids == full[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id
    min_new = first + 3
    params = SamplingParams(
        temperature=0.0, max_new_tokens=40, stop_token_ids=[stop_id], min_new_tokens=min_new
    )
    out = engine.generate([PROMPTS[1]], params)[0].outputs[0]
    assert stop_id not in out.token_ids[:min_new] and len(out.token_ids) > min_new
    assert out.token_ids[:first] == full[:first]
    assert out.finish_reason == "length" or out.token_ids[-1] == stop_id


def test_eos_stops_unless_ignored(tiny_model, greedy_ref, tmp_path):
    # A copy of the model whose eos is a token the greedy output produces.
    full = greedy_ref.outputs[0].token_ids
    eos = full[6]
    path = shutil.copytree(tiny_model("llama"), tmp_path / "eos_model")
    for name in ("config.json", "generation_config.json"):
        config = json.loads((path / name).read_text())
        config["eos_token_id"] = eos
        (path / name).write_text(json.dumps(config))
    engine = LLMEngine(path, cpu_config(max_model_len=128, block_size=8))
    out = engine.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_new_tokens=40))[0].outputs[0]
    assert out.token_ids == full[: full.index(eos) + 1] and out.finish_reason == "stop"
    ignored = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    out = engine.generate([PROMPTS[1]], ignored)[0].outputs[0]
    assert out.token_ids == full and out.finish_reason == "length"
    min_new = full.index(eos) + 2
    out = engine.generate(
        [PROMPTS[1]], SamplingParams(temperature=0.0, max_new_tokens=40, min_new_tokens=min_new)
    )
    assert eos not in out[0].outputs[0].token_ids[:min_new]


def test_max_model_len_ends_with_length(engine):
    out = engine.generate(
        [list(range(5, 125))], SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 8 and out[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(max_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=4, min_new_tokens=5), "min_new_tokens"),
        (dict(n=0), "n must"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_vllm_aliases():
    params = SamplingParams(max_tokens=7, min_tokens=2, top_k=0, stop="x")
    assert (params.max_new_tokens, params.min_new_tokens, params.top_k, params.stop) == (7, 2, -1, ["x"])
