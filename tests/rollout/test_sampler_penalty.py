"""``SamplingParams.repetition_penalty`` (``--repetition_penalty``): Hugging Face's semantics in the
sampler, by hand and against ``transformers.generate``; the default 1.0 leaves sampling as it was."""

from __future__ import annotations

import pytest
import torch

from tests.rollout.reference import PROMPTS, cpu_config
from tidal.rollout import EngineConfig, LLMEngine, SamplingParams
from tidal.rollout.runner.sampler import Sampler, SamplingTensors, apply_repetition_penalty


def test_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [1.0, 1.0, 1.0, 1.0]])
    out = apply_repetition_penalty(
        logits, torch.tensor([0, 0]), torch.tensor([0, 1]), torch.tensor([2.0, 2.0])
    )
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0], [1.0, 1.0, 1.0, 1.0]]
    assert logits[0, 0] == 2.0  # not in place


def test_greedy_row_picks_the_penalized_argmax_and_logprobs_stay_raw():
    logits = torch.tensor([[3.0, -1.0, 0.5, 2.0], [3.0, -1.0, 0.5, 2.0]])
    st = SamplingTensors(  # row 0 has seen token 0 (penalty 2: 3.0 -> 1.5 < 2.0); row 1 has no penalty
        all_greedy=True,
        penalty_rows=torch.tensor([0]),
        penalty_tokens=torch.tensor([0]),
        penalties=torch.tensor([2.0]),
    )
    tokens, logprobs = Sampler.reference(logits, st)
    assert tokens.tolist() == [3, 0]
    torch.testing.assert_close(logprobs, logits.log_softmax(-1)[[0, 1], [3, 0]])


def test_sampled_rows_draw_from_the_penalized_distribution():
    """With temperature T the penalized logit is (x / p) / T for x > 0: token 0's 2.0 becomes 0.5 at
    p = 4, below token 1's 1.0, and sampling with a huge |logit| gap makes that deterministic."""
    logits = torch.tensor([[40.0, 20.0, -50.0]])
    st = SamplingTensors(
        all_greedy=False,
        temperatures=torch.tensor([2.0]),
        seeds=torch.tensor([7]),
        positions=torch.tensor([0]),
        penalty_rows=torch.tensor([0]),
        penalty_tokens=torch.tensor([0]),
        penalties=torch.tensor([4.0]),
    )
    tokens, logprobs = Sampler.reference(logits, st)
    assert tokens.tolist() == [1]  # 40 / 4 = 10 < 20
    torch.testing.assert_close(logprobs, (logits / 2.0).log_softmax(-1)[:, 1])


@torch.inference_mode()
def _hf_greedy_penalized(model, prompt: list[int], max_new_tokens: int, penalty: float) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens, repetition_penalty=penalty
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_greedy_engine_matches_transformers_generate(penalty, tiny_model, hf_model):
    path = tiny_model("llama")
    hf = hf_model(path)
    engine = LLMEngine(path, cpu_config(max_model_len=128, block_size=4, max_num_seqs=8))
    params = SamplingParams(temperature=0.0, max_new_tokens=16, repetition_penalty=penalty, ignore_eos=True)
    plain = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    outputs = engine.generate(PROMPTS, params)
    unpenalized = engine.generate(PROMPTS, plain)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy_penalized(hf, prompt, 16, penalty)
    # The penalty matters on this model (the check above would be vacuous otherwise).
    assert [o.outputs[0].token_ids for o in outputs] != [o.outputs[0].token_ids for o in unpenalized]


def test_penalty_applies_per_request_in_a_shared_batch(tiny_model):
    """A penalized request batched with unpenalized ones: each gets what it gets alone."""
    engine = LLMEngine(tiny_model("llama"), cpu_config(max_model_len=128, block_size=4, max_num_seqs=8))
    plain = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    penalized = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, repetition_penalty=5.0)
    params = [plain, penalized, greedy]
    mixed = engine.generate(PROMPTS[:3], params)
    alone = [engine.generate([p], q)[0] for p, q in zip(PROMPTS[:3], params, strict=True)]
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in alone]


def test_penalty_must_be_positive():
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        SamplingParams(repetition_penalty=0.0)
    assert not SamplingParams().penalizes_repetition


@pytest.mark.gpu
def test_cuda_penalized_sampling_takes_the_torch_path_and_matches_hf(tiny_model):
    """On CUDA (fused sampling kernel, decode CUDA graphs) a penalized batch still gets the penalty:
    greedy and sampled rows mixed, the greedy ones equal ``transformers.generate``."""
    from transformers import AutoModelForCausalLM

    path = tiny_model("llama")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
    engine = LLMEngine(path, EngineConfig(device="cuda", dtype="float32", max_model_len=128, block_size=4))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True, repetition_penalty=1.5)
    sampled = SamplingParams(
        temperature=1.0, max_new_tokens=16, ignore_eos=True, seed=1, repetition_penalty=1.5
    )
    outputs = engine.generate(PROMPTS, [greedy, sampled, greedy, sampled])
    for prompt, out in zip(PROMPTS[::2], outputs[::2], strict=True):
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([prompt], device="cuda"),
                do_sample=False,
                max_new_tokens=16,
                repetition_penalty=1.5,
            )
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()
