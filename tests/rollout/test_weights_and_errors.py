"""Weight updates, sleep / wake-up, and clear errors for unsupported models and bad requests."""

from __future__ import annotations

import pytest

from tests.rollout.reference import PROMPTS, cpu_config, hf_greedy
from tidal.rollout import LLMEngine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # untied and tied embeddings
def test_update_weights_matches_the_new_model(family, tiny_model, hf_model):
    engine = LLMEngine(tiny_model(family, seed=0), cpu_config(max_model_len=64, block_size=4))
    before = engine.generate(PROMPTS[:2], GREEDY)
    new = hf_model(tiny_model(family, seed=1))
    assert engine.update_weights(new.named_parameters()) == len(list(new.named_parameters()))
    after = engine.generate(PROMPTS[:2], GREEDY)
    for prompt, old, out in zip(PROMPTS[:2], before, after, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(new, prompt, 16)
        assert out.outputs[0].token_ids != old.outputs[0].token_ids


def test_update_weights_rejects_unknown_names_and_shapes(tiny_model, hf_model):
    engine = LLMEngine(tiny_model("llama"), cpu_config(max_model_len=64))
    weight = hf_model(tiny_model("llama")).model.norm.weight
    with pytest.raises(ValueError, match="unexpected weight 'model.vision_tower.weight'"):
        engine.update_weights({"model.vision_tower.weight": weight})
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights({"model.norm.weight": weight[:-1]})


def test_engine_from_loaded_model_and_state_dict(tiny_model, hf_model):
    path = tiny_model("qwen3")
    hf = hf_model(path)
    expected = hf_greedy(hf, PROMPTS[0], 16)
    from_model = LLMEngine(None, cpu_config(max_model_len=64), model=hf)
    from_state = LLMEngine(path, cpu_config(max_model_len=64), state_dict=hf.state_dict())
    for engine in (from_model, from_state):
        assert engine.generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids == expected


def test_sleep_frees_kv_cache_and_wake_up_restores_it(tiny_model):
    engine = LLMEngine(tiny_model("mistral"), cpu_config(max_model_len=64, block_size=4))
    before = engine.generate(PROMPTS, GREEDY)
    engine.sleep()
    assert engine.is_sleeping and engine.runner.kv_cache is None
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.generate(PROMPTS, GREEDY)
    engine.wake_up()
    after = engine.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]


def test_unsupported_architecture_is_named(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt2'.*llama.*mistral.*qwen2.*qwen3"):
        LLMEngine(tmp_path, cpu_config(max_model_len=64))


def test_bad_requests_fail_clearly(tiny_model):
    engine = LLMEngine(tiny_model("llama"), cpu_config(max_model_len=32, max_num_seqs=4))
    with pytest.raises(ValueError, match="prompt 1 has 40 tokens but max_model_len is 32"):
        engine.generate([[5, 6], list(range(40))], GREEDY)
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[5, 100000]], GREEDY)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        engine.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="n=5 exceeds max_num_seqs=4"):
        engine.generate([[5, 6]], SamplingParams(n=5))
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        engine.generate([[5, 6]], [GREEDY, GREEDY])
    small = LLMEngine(tiny_model("llama"), cpu_config(max_model_len=32, block_size=4, num_kv_blocks=3))
    with pytest.raises(ValueError, match="request 0 needs 5 KV blocks"):
        small.generate([list(range(5, 15))], SamplingParams(max_new_tokens=8))


def test_string_prompts_are_tokenized(tiny_model):
    engine = LLMEngine(tiny_model("qwen2"), cpu_config(max_model_len=64))
    text = "What is 12+30?"
    by_text, by_ids = engine.generate([text, engine.tokenizer.encode(text)], GREEDY)
    assert by_text.prompt == text and by_text.prompt_token_ids == by_ids.prompt_token_ids
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.outputs[0].text == engine.tokenizer.decode(
        by_text.outputs[0].token_ids, skip_special_tokens=True
    )


def test_interrupted_generate_leaves_a_clean_engine(tiny_model, monkeypatch):
    engine = LLMEngine(tiny_model("llama"), cpu_config(max_model_len=64, block_size=4))
    expected = engine.generate(PROMPTS, GREEDY)
    calls = []
    run = engine.runner.run

    def failing_run(batch):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return run(batch)

    monkeypatch.setattr(engine.runner, "run", failing_run)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(PROMPTS, GREEDY, use_tqdm=True)
    monkeypatch.setattr(engine.runner, "run", run)
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks
    assert [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY)] == [
        o.outputs[0].token_ids for o in expected
    ]
