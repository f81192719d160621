"""Top-k log-prob alternatives in ``tidal serve`` (OpenAI semantics) through the ``openai`` client over
loopback: chat ``top_logprobs`` and completions ``logprobs: k``, streaming and not, each value checked
against a float32 HF forward's ``log_softmax(logits / temperature)``."""

from __future__ import annotations

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from tidal.rollout import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from tidal.serve import OpenAIServer  # noqa: E402
from tidal.serve.protocol import token_bytes  # noqa: E402

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "What is 2+3?"}]


def _engine(path) -> LLMEngine:
    config = EngineConfig(device="cpu", dtype="float32", max_num_seqs=8, num_kv_blocks=64, max_model_len=128)
    return LLMEngine(path, config)


@pytest.fixture(scope="module")
def ref(tiny_llama):
    """A second engine: the sampled ids of a seeded request (the server's answers are text)."""
    return _engine(tiny_llama)


@pytest.fixture(scope="module")
def hf(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def client(tiny_llama):
    with OpenAIServer(_engine(tiny_llama), MODEL) as server:
        yield openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def _chat_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def _hf_top(hf, prompt: list[int], output: list[int], temperature: float, k: int):
    """Per output position: the k most likely (token id, log-prob) of log_softmax(logits / T)."""
    logits = hf(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    top = (logits / (temperature or 1.0)).log_softmax(-1).topk(k)
    return [
        list(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(top.indices, top.values, strict=True)
    ]


def test_chat_top_logprobs_match_hf(client, ref, hf):
    k, temperature = 5, 0.8
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, seed=7, temperature=temperature, logprobs=True,
        top_logprobs=k,
    )  # fmt: skip
    prompt = _chat_ids(ref.tokenizer)
    (want,) = ref.generate([prompt], SamplingParams(max_new_tokens=8, seed=7, temperature=temperature))[
        0
    ].outputs
    content = r.choices[0].logprobs.content
    assert len(content) == len(want.token_ids)
    tok = ref.tokenizer
    expected_tops = _hf_top(hf, prompt, want.token_ids, temperature, k)
    for entry, sampled, expected in zip(content, want.token_ids, expected_tops, strict=True):
        assert len(entry.top_logprobs) == k
        values = [alt.logprob for alt in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert [alt.token for alt in entry.top_logprobs] == [tok.decode([t]) for t, _ in expected]
        assert values == pytest.approx([v for _, v in expected], abs=1e-5)
        for alt, (t, _) in zip(entry.top_logprobs, expected, strict=True):  # the token's own bytes
            assert alt.bytes == list(token_bytes(tok, t))
            assert "\ufffd" in alt.token or alt.bytes == list(alt.token.encode())
        ids = [t for t, _ in expected]
        if sampled in ids:  # the sampled token carries the same number in both places
            assert entry.logprob == values[ids.index(sampled)]
    # Greedy: the sampled token is the most likely one, with the very same log-prob.
    greedy = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    for entry in greedy.choices[0].logprobs.content:
        assert (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob) == (entry.token, entry.logprob)


def test_chat_stream_carries_the_same_alternatives(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=6, seed=3, logprobs=True, top_logprobs=3)
    full = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [
        entry
        for chunk in client.chat.completions.create(stream=True, **kwargs)
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in full]


def test_completion_logprobs_k_lists_the_k_best_and_the_sampled_token(client, ref, hf):
    k = 3
    kwargs = dict(model=MODEL, prompt="the number", max_tokens=6, seed=2, logprobs=k)
    choice = client.completions.create(**kwargs).choices[0]
    prompt = ref.tokenizer.encode("the number")
    (want,) = ref.generate([prompt], SamplingParams(max_new_tokens=6, seed=2))[0].outputs
    logprobs = choice.logprobs
    assert len(logprobs.top_logprobs) == len(want.token_ids)
    expected_tops = _hf_top(hf, prompt, want.token_ids, 1.0, k)
    for token, logprob, alternatives, expected in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, expected_tops, strict=True
    ):
        best: dict[str, float] = {}  # texts shared by several tokens (e.g. U+FFFD) keep the most likely
        for t, v in expected:
            best.setdefault(ref.tokenizer.decode([t]), v)
        assert set(alternatives) == set(best) | {token}
        for text, value in best.items():
            assert alternatives[text] == pytest.approx(value, abs=1e-5)
        if token not in best:
            assert alternatives[token] == logprob
    streamed = [
        top
        for chunk in client.completions.create(stream=True, **kwargs)
        for top in (chunk.choices[0].logprobs.top_logprobs or [])
    ]
    assert streamed == logprobs.top_logprobs


def test_k_zero_returns_no_alternatives(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, seed=1, logprobs=True, top_logprobs=0
    )
    assert all(entry.top_logprobs == [] for entry in chat.choices[0].logprobs.content)
    completion = client.completions.create(model=MODEL, prompt="a", max_tokens=4, seed=1, logprobs=0)
    assert completion.choices[0].logprobs.top_logprobs is None
    assert len(completion.choices[0].logprobs.token_logprobs) == 4
