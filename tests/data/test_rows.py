"""Bad rows are found in the whole dataset before any sample is built, named by file and 1-based row;
JSON labels keep their type as written; a non-UTF-8 line names its line."""

from __future__ import annotations

import json

import datasets
import pytest

from tidal.data import DataError, build_prompt_samples, build_sft_samples, load_dataset_spec
from tidal.data.rows import row_name
from tidal.data.sft import SFTDataConfig


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_one_integer_label_among_strings_keeps_every_label_as_written(tmp_path, qwen_tok):
    rows = [{"input": f"{i}+1=", "label": "8"} for i in range(6)]
    rows[3]["label"] = 7
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    samples, _ = build_prompt_samples(load_dataset_spec(str(path)), qwen_tok, "input", "label")
    assert [s.label for s in samples] == ["8", "8", "8", 7, "8", "8"]  # datasets gave [8, 8, 8, 7, 8, 8]
    # the README's reward_func compares strings: every string label still matches
    assert sum(s.label == "8" for s in samples) == 5


def test_json_array_file_keeps_mixed_types(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"input": "a", "label": 7}, {"input": "b", "label": "8"}, {"input": "c"}]))
    assert list(load_dataset_spec(str(path))["label"]) == [7, "8", None]


def test_non_utf8_line_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"input": "a"}\n{"input": "caf\xe9"}\n')
    with pytest.raises(DataError, match=rf"{path} line 2 is not valid UTF-8 \(byte 0xe9 at column 15\)"):
        load_dataset_spec(str(path))


def test_empty_prompt_in_row_40_fails_before_any_sample(tmp_path, qwen_tok):
    rows = [{"input": f"{i}+1=", "label": str(i + 1)} for i in range(60)]
    rows[39]["input"] = ""
    path = write_jsonl(tmp_path / "prompts.jsonl", rows)
    with pytest.raises(DataError) as info:
        build_prompt_samples(load_dataset_spec(str(path)), qwen_tok, "input", "label", source=str(path))
    assert str(info.value) == f"1 bad row(s) in {path}: row 40 of {path}: key 'input' is empty"


def test_bad_rows_are_reported_together_with_their_file_in_a_blend(tmp_path, qwen_tok):
    good = write_jsonl(tmp_path / "good.jsonl", [{"input": f"q{i}"} for i in range(10)])
    bad_rows = [{"input": f"q{i}"} for i in range(10)]
    for i in (1, 3, 4, 5, 6, 8):
        bad_rows[i]["input"] = "  " if i != 3 else None
    bad_rows[8]["input"] = 5
    bad = write_jsonl(tmp_path / "bad.jsonl", bad_rows)
    spec = f"{good},{bad}"
    ds = load_dataset_spec(spec, probs="0.5,0.5", seed=1)
    with pytest.raises(DataError) as info:
        build_prompt_samples(ds, qwen_tok, "input", source=spec)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"6 bad row(s) in {spec}: ")
    assert f"of {good}" not in message and message.endswith("; and 1 more")
    for line in ("row 2 of", "row 4 of", "row 5 of"):
        assert f"{line} {bad}" in message


def test_int_prompt_in_the_column_fails_with_type(tmp_path, qwen_tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"input": "a", "output": "b"}, {"input": 12, "output": "c"}])
    with pytest.raises(
        DataError, match=r"row 2 of .*p\.jsonl: key 'input' is a int \('12'\), expected a string"
    ):
        build_sft_samples(load_dataset_spec(str(path)), qwen_tok, SFTDataConfig(), source=str(path))


def test_row_names_follow_files_through_concatenation_and_caps(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"x": i} for i in range(3)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"x": 10 + i} for i in range(3)])
    ds = load_dataset_spec(f"{a},{b}")
    assert [row_name(ds, i) for i in range(len(ds))] == [f"row {r} of {f}" for f in (a, b) for r in (1, 2, 3)]
    blended = load_dataset_spec(f"{a},{b}", probs="0.5,0.5", max_samples=2)
    assert [row_name(blended, i) for i in range(len(blended))] == [
        f"row {x % 10 + 1} of {a if x < 10 else b}" for x in blended["x"]
    ]
    assert row_name(datasets.Dataset.from_list([{"x": 1}]), 0, "spec") == "row 1 of spec"
