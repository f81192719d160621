"""SFT loss masks, checked token by token against independently tokenized pieces."""

from __future__ import annotations

import datasets
import pytest

from tidal.data import DataError, SFTDataConfig, build_sft_samples
from tidal.data.sft import mask_from_spans

TEMPLATE = "User: {}\nAssistant: "


def _ds(rows):
    return datasets.Dataset.from_list(rows)


def _ids(tok, text, special=False):
    return tok(text, add_special_tokens=special)["input_ids"]


def _trained_runs(sample):
    """Contiguous runs of trained token ids."""
    runs, current = [], []
    for token, m in zip(sample.input_ids, sample.loss_mask, strict=True):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def test_input_template_masks_exactly_response_and_eos(any_tok):
    tok = any_tok
    rows = [{"input": "What is 2+3?", "output": "5"}, {"input": "7+8?", "output": "15"}]
    samples, stats = build_sft_samples(_ds(rows), tok, SFTDataConfig(input_template=TEMPLATE))
    assert stats.count == 0 and len(samples) == 2
    for sample, row in zip(samples, rows, strict=True):
        prompt = _ids(tok, TEMPLATE.format(row["input"]), special=True)  # llama: bos + prompt
        response = _ids(tok, row["output"] + tok.eos_token)
        assert sample.input_ids == prompt + response
        assert sample.loss_mask == [0] * len(prompt) + [1] * len(response)
        assert sample.input_ids[-1] == tok.eos_token_id


def test_chat_template_masks_exactly_assistant_content_and_im_end(any_tok):
    tok = any_tok
    rows = [{"input": "hello there", "output": "The answer is 5"}]
    samples, _ = build_sft_samples(_ds(rows), tok, SFTDataConfig(apply_chat_template=True))
    prompt_text = tok.apply_chat_template(
        [{"role": "user", "content": "hello there"}], tokenize=False, add_generation_prompt=True
    )
    prompt, response = _ids(tok, prompt_text), _ids(tok, "The answer is 5<|im_end|>")
    assert samples[0].input_ids == prompt + response
    assert samples[0].loss_mask == [0] * len(prompt) + [1] * len(response)
    assert tok.decode([t for t, m in zip(samples[0].input_ids, samples[0].loss_mask, strict=True) if m]) == (
        "The answer is 5<|im_end|>"
    )


def test_bos_exactly_once(llama_tok, qwen_tok):
    rows = [{"input": "hi", "output": "5"}]
    for cfg in (SFTDataConfig(input_template=TEMPLATE), SFTDataConfig(apply_chat_template=True)):
        llama = build_sft_samples(_ds(rows), llama_tok, cfg)[0][0]
        assert (
            llama.input_ids.count(llama_tok.bos_token_id) == 1
            and llama.input_ids[0] == llama_tok.bos_token_id
        )
        qwen = build_sft_samples(_ds(rows), qwen_tok, cfg)[0][0]
        assert qwen_tok.convert_tokens_to_ids("<|bos|>") not in qwen.input_ids


def test_multiturn_trains_every_assistant_turn_only(any_tok):
    tok = any_tok
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is 1+1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "and 2+2?"},
        {"role": "assistant", "content": "it is 4"},
    ]
    cfg = SFTDataConfig(input_key="messages", output_key=None, apply_chat_template=True, multiturn=True)
    sample = build_sft_samples(_ds([{"messages": messages}]), tok, cfg)[0][0]
    runs = _trained_runs(sample)
    assert [tok.decode(r) for r in runs] == ["2<|im_end|>", "it is 4<|im_end|>"]
    assert sample.input_ids == _ids(tok, tok.apply_chat_template(messages, tokenize=False).rstrip())
    # from the CLI output_key keeps its default "output": absent from a conversation dataset, it means none
    default_key = SFTDataConfig(input_key="messages", apply_chat_template=True, multiturn=True)
    assert build_sft_samples(_ds([{"messages": messages}]), tok, default_key)[0][0] == sample
    untrained = tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if not m])
    assert "what is 1+1?" in untrained and "and 2+2?" in untrained and "be brief" in untrained


def test_pretrain_mode_trains_every_token_but_the_first(any_tok):
    rows = [{"text": "the quick water", "x": 1}]
    cfg = SFTDataConfig(input_key="text", output_key=None, pretrain_mode=True)
    sample = build_sft_samples(_ds(rows), any_tok, cfg)[0][0]
    assert sample.input_ids == _ids(any_tok, "the quick water" + any_tok.eos_token, special=True)
    assert sample.loss_mask == [0] + [1] * (len(sample) - 1)
    with_output = SFTDataConfig(input_template=TEMPLATE, pretrain_mode=True)
    sample = build_sft_samples(_ds([{"input": "a", "output": "b"}]), any_tok, with_output)[0][0]
    assert sample.loss_mask == [0] + [1] * (len(sample) - 1)


def test_token_straddling_the_boundary_is_trained():
    # A BPE token merging the template's trailing space with the first response word carries
    # response text, so it is trained; zero-width special tokens (bos from plain encoding) never are.
    offsets = [(0, 0), (0, 4), (4, 10), (10, 14), (14, 14)]
    assert mask_from_spans(offsets, [(5, 14)]) == [0, 0, 1, 1, 0]
    assert mask_from_spans(offsets, [(0, 14)]) == [0, 1, 1, 1, 0]  # first token never trained
    assert mask_from_spans([(0, 3), (3, 6), (6, 9)], [(3, 6)]) == [0, 1, 0]


def test_overlong_and_targetless_samples_are_skipped_and_counted(qwen_tok):
    rows = [
        {"input": "short", "output": "1"},
        {"input": "word " * 50, "output": "2"},
        {"input": "ok", "output": "3"},
    ]
    samples, stats = build_sft_samples(_ds(rows), qwen_tok, SFTDataConfig(max_len=16))
    assert [s.row for s in samples] == [0, 2]
    assert (stats.too_long, stats.no_target, stats.count, stats.rows) == (1, 0, 1, [1])
    assert "1 longer than max_len" in stats.summary()
    # pretrain text of a single token: nothing can be predicted
    cfg = SFTDataConfig(input_key="input", output_key=None, pretrain_mode=True)
    samples, stats = build_sft_samples(_ds([{"input": ""}, {"input": "hi"}]), qwen_tok, cfg)
    assert [s.row for s in samples] == [1] and stats.no_target == 1
    with pytest.raises(DataError, match=r"no usable SFT sample in my\.jsonl.*2 longer than max_len"):
        build_sft_samples(_ds(rows[1:2] * 2), qwen_tok, SFTDataConfig(max_len=16), source="my.jsonl")


def test_missing_key_names_key_row_and_columns(qwen_tok):
    ds = _ds([{"input": "a", "output": "b"}, {"input": "c", "output": None}])
    with pytest.raises(DataError, match=r"row 2 of d\.jsonl: key 'output' has no value"):
        build_sft_samples(ds, qwen_tok, SFTDataConfig(), source="d.jsonl")
    with pytest.raises(DataError, match=r"'question' not found in d\.jsonl.*\['input', 'output'\]"):
        build_sft_samples(ds, qwen_tok, SFTDataConfig(input_key="question"), source="d.jsonl")


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (SFTDataConfig(output_key=None), "--output_key is required"),
        (SFTDataConfig(multiturn=True, output_key=None), "--multiturn needs --apply_chat_template"),
        (SFTDataConfig(input_template="no placeholder"), "must contain"),
    ],
)
def test_config_errors(qwen_tok, cfg, match):
    with pytest.raises(DataError, match=match):
        build_sft_samples(_ds([{"input": "a", "output": "b"}]), qwen_tok, cfg)


def test_message_list_without_chat_template_is_an_error(qwen_tok):
    ds = _ds([{"input": [{"role": "user", "content": "a"}], "output": "b"}])
    with pytest.raises(DataError, match="row 1 of dataset: key 'input' .*--apply_chat_template"):
        build_sft_samples(ds, qwen_tok, SFTDataConfig())
