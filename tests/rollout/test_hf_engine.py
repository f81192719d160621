"""The transformers fallback (``HFEngine``): for a family the engine knows, forced onto the fallback, it
samples exactly what ``LLMEngine`` samples (same ids, log-probs within 1e-5, finish reasons, texts) for
greedy and seeded requests with n > 1, stop strings, min/max tokens, repetition penalty and top log-probs;
its step-level API, weight updates and sleep/wake; ``make_engine``'s choice and notice; a hybrid Mamba
(bamba) and gpt2, outside the registry, equal ``transformers.generate``; refused features in one line."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.rollout.reference import PROMPTS, assert_same_outputs, cpu_config, greedy, hf_greedy, hf_logprobs
from tidal.rollout import EngineConfig, HFEngine, LLMEngine, SamplingParams, make_engine
from tidal.testing.tiny import build_tiny_fallback_model

REQUESTS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
    "seeded_n3_top": SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=9, logprobs=3),
    "truncated_stop": SamplingParams(
        n=2, temperature=0.8, top_p=0.9, top_k=20, seed=5, max_tokens=10, stop=["a"], min_tokens=2
    ),
    "penalty_unseeded": SamplingParams(n=2, temperature=1.0, max_tokens=8, repetition_penalty=1.3),
}


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    return build_tiny_fallback_model(tmp_path_factory.mktemp("tiny_bamba"), "bamba", seed=0)


def assert_same_completions(expected, got) -> None:
    assert_same_outputs(expected, got)
    for a, b in zip(expected, got, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert (x.text, x.finish_reason, x.stop_reason) == (y.text, y.finish_reason, y.stop_reason)
            assert (x.top_logprobs is None) == (y.top_logprobs is None)
            for u, v in zip(x.top_logprobs or [], y.top_logprobs or [], strict=True):
                assert [i for i, _ in u] == [i for i, _ in v]
                assert max(abs(p - q) for (_, p), (_, q) in zip(u, v, strict=True)) < 1e-5


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_fallback_samples_what_the_native_engine_samples(tiny_model, family):
    path = tiny_model(family)
    native, fallback = LLMEngine(path, cpu_config(seed=3)), HFEngine(path, cpu_config(seed=3))
    reasons = set()
    for name, params in REQUESTS.items():
        expected, got = native.generate(PROMPTS, params), fallback.generate(PROMPTS, params)
        assert_same_completions(expected, got)
        reasons |= {(name, o.finish_reason) for r in got for o in r.outputs}
    # The stop string ended some samples and max_tokens others: both rules were exercised.
    assert {("truncated_stop", "stop"), ("truncated_stop", "length")} <= reasons
    # A stop token id: the 4th greedy token of the first prompt ends that request there.
    token = native.generate(PROMPTS[:1], REQUESTS["greedy"])[0].outputs[0].token_ids[3]
    params = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[token])
    expected, got = native.generate(PROMPTS, params), fallback.generate(PROMPTS, params)
    assert_same_completions(expected, got)
    assert (got[0].outputs[0].finish_reason, got[0].outputs[0].stop_reason) == ("stop", token)
    # n samples of a seeded request differ (each its own noise), and their prompt was prefilled once.
    seeded = fallback.generate(PROMPTS[:1], REQUESTS["seeded_n3_top"])[0].outputs
    assert len({tuple(o.token_ids) for o in seeded}) == 3


def test_step_level_requests_join_and_leave(tiny_model):
    """Requests added between steps share the running batch; an aborted one stops; each output equals
    the same seeded request run alone through ``generate``."""
    path = tiny_model("qwen2")
    engine = HFEngine(path, cpu_config(max_num_seqs=4))
    params = [
        SamplingParams(n=2, temperature=1.0, seed=s, max_tokens=6 + s, ignore_eos=True) for s in range(3)
    ]
    first = engine.add_request(PROMPTS[0], params[0])
    engine.step()
    engine.step()
    second = engine.add_request(PROMPTS[1], params[1])
    doomed = engine.add_request(PROMPTS[2], params[2])  # waits: 2 + 2 rows fill max_num_seqs, 2 more do not
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if second in done and doomed not in done:  # admitted when first ended, stopped mid-way
            assert engine.abort(doomed)
    assert set(done) == {first, second} and not engine.abort(doomed)
    for request_id, index in ((first, 0), (second, 1)):
        alone = engine.generate([PROMPTS[index]], params[index])
        assert_same_completions(alone, [done[request_id]])


def test_weights_update_and_sleep(tiny_model, hf_model, capfd):
    path, other = tiny_model("qwen2"), tiny_model("qwen2", seed=1)
    engine = HFEngine(path, cpu_config())
    loaded = engine.update_weights(hf_model(other).named_parameters())
    assert loaded == len(list(hf_model(other).named_parameters()))
    engine.sleep(2)
    assert engine.is_sleeping
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS[:1], greedy(4))
    engine.wake_up()
    capfd.readouterr()
    out = engine.generate(PROMPTS[:2], greedy(8), use_tqdm=True)
    assert "rollout: 100%|██████████| 2/2" in capfd.readouterr().err  # the progress bar counts requests
    for prompt, request in zip(PROMPTS[:2], out, strict=True):
        ids = request.outputs[0].token_ids
        assert ids == hf_greedy(hf_model(other), prompt, 8)
        assert torch.allclose(
            torch.tensor(request.outputs[0].logprobs), hf_logprobs(hf_model(other), prompt, ids), atol=1e-5
        )
    with pytest.raises(ValueError, match="unexpected weight 'nope.weight' for a qwen2 model"):
        engine.update_weights({"nope.weight": torch.zeros(1)})


@torch.inference_mode()
def hf_generate(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy ids and the log-prob of each from its own decode-step logits (a recurrent
    layer's step-by-step state differs from a full forward's chunked scan by ~1e-4 in float32)."""
    out = model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
        output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    ids = out.sequences[0, len(prompt) :]
    logprobs = torch.stack(
        [step[0].float().log_softmax(-1)[i] for step, i in zip(out.logits, ids, strict=True)]
    )
    return ids.tolist(), logprobs


@pytest.mark.parametrize("family", ["bamba", "gpt2"])
def test_unregistered_family_equals_transformers_generate(tmp_path, family, caplog):
    path = build_tiny_fallback_model(tmp_path / family, family)
    with caplog.at_level(logging.WARNING, logger="tidal"):
        engine = make_engine(path, cpu_config(max_model_len=256))
    assert isinstance(engine, HFEngine)
    notice = f"{family}: not native to tidal's engine; generating with transformers (slower)"
    assert [r.getMessage() for r in caplog.records if "not native" in r.getMessage()] == [notice]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = engine.generate(PROMPTS, greedy(8))
    for prompt, request in zip(PROMPTS, out, strict=True):
        ids, logprobs = hf_generate(model, prompt, 8)
        assert request.outputs[0].token_ids == ids
        assert torch.allclose(torch.tensor(request.outputs[0].logprobs), logprobs, atol=1e-5)


def test_make_engine_keeps_registry_families_native(tiny_model):
    assert type(make_engine(tiny_model("qwen2"), cpu_config(max_model_len=128))) is LLMEngine


@pytest.mark.parametrize(
    "setting, feature",
    [
        (dict(tp_size=2), "tensor_parallel (tp_size > 1)"),
        (dict(enable_prefix_caching=True), "prefix_caching"),
        (dict(enable_chunked_prefill=True), "chunked_prefill"),
        (dict(exact_logprobs=True), "exact_logprobs"),
        (dict(async_scheduling=True), "async_scheduling"),
    ],
)
def test_fallback_refuses_features_it_lacks(bamba, setting, feature):
    with pytest.raises(ValueError) as err:
        make_engine(bamba, EngineConfig(device="cpu", **setting))
    assert str(err.value) == (
        f"EngineConfig: {feature} is not supported for the bamba family: it is not native to tidal's engine "
        "and runs on the transformers fallback, which lacks it"
    )


def test_a_model_type_that_is_no_causal_lm_is_one_line(tmp_path):
    from transformers import ViTConfig

    ViTConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=32
    ).save_pretrained(tmp_path)
    with pytest.raises(ValueError) as err:
        make_engine(tmp_path, cpu_config(max_model_len=64))
    assert str(err.value) == (
        "model_type 'vit' is neither a family of tidal's engine nor a causal LM transformers can load "
        "(AutoModelForCausalLM)"
    )


@pytest.mark.gpu
def test_fallback_on_cuda_equals_transformers_generate(bamba):
    """bfloat16 on the GPU (the engine's CUDA default): greedy ids equal transformers' on the same model."""
    from transformers import AutoModelForCausalLM

    engine = make_engine(bamba, EngineConfig(device="cuda", max_model_len=256))
    assert isinstance(engine, HFEngine) and engine.dtype == torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(str(bamba), dtype=torch.bfloat16).to("cuda").eval()
    out = engine.generate(PROMPTS, greedy(8))
    for prompt, request in zip(PROMPTS, out, strict=True):
        with torch.inference_mode():
            ids = model.generate(torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=8)
        assert request.outputs[0].token_ids == ids[0, len(prompt) :].tolist()
    engine.sleep(2)
    engine.wake_up()
    assert engine.generate(PROMPTS[:1], greedy(8))[0].outputs[0].token_ids == out[0].outputs[0].token_ids
