"""Loading every supported source, blending with --dataset_probs, and clear errors on bad input."""

from __future__ import annotations

import json
import time

import datasets
import pytest

from tidal.data import DataError, load_dataset_spec, loading, require_keys

ROWS = [{"input": f"q{i}", "output": f"a{i}"} for i in range(20)]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _dataset(rows=ROWS, tag=None):
    rows = [{**r, "src": tag} for r in rows] if tag else rows
    return datasets.Dataset.from_list(rows)


@pytest.mark.parametrize("ext", ["json", "jsonl", "csv", "parquet", "arrow"])
def test_each_file_type_loads(tmp_path, ext):
    path = tmp_path / f"data.{ext}"
    ds = _dataset()
    if ext == "json":
        path.write_text(json.dumps(ROWS))  # a JSON array, not JSON lines
    elif ext == "jsonl":
        _write_jsonl(path, ROWS)
    elif ext == "csv":
        ds.to_csv(str(path))
    elif ext == "parquet":
        ds.to_parquet(str(path))
    else:
        ds.save_to_disk(str(tmp_path / "saved"))
        path = next((tmp_path / "saved").glob("*.arrow"))
    loaded = load_dataset_spec(str(path))
    assert loaded.to_list() == ROWS


def test_save_to_disk_folders_and_split(tmp_path):
    _dataset().save_to_disk(str(tmp_path / "single"))
    dd = datasets.DatasetDict({"train": _dataset(ROWS[:5]), "test": _dataset(ROWS[5:8])})
    dd.save_to_disk(str(tmp_path / "dict"))
    assert len(load_dataset_spec(str(tmp_path / "single"))) == 20
    assert load_dataset_spec(str(tmp_path / "dict")).to_list() == ROWS[:5]
    assert load_dataset_spec(str(tmp_path / "dict"), split="test").to_list() == ROWS[5:8]
    with pytest.raises(DataError, match=r"split 'dev' not found.*\['test', 'train'\]"):
        load_dataset_spec(str(tmp_path / "dict"), split="dev")


def test_folder_of_data_files(tmp_path):
    folder = tmp_path / "files"
    folder.mkdir()
    _write_jsonl(folder / "train.jsonl", ROWS[:6])
    _write_jsonl(folder / "test.jsonl", ROWS[6:9])
    assert load_dataset_spec(str(folder)).to_list() == ROWS[:6]
    assert load_dataset_spec(str(folder), split="test").to_list() == ROWS[6:9]


def test_blend_with_probs_proportions_and_determinism(tmp_path):
    a = _dataset([{"input": f"a{i}", "output": ""} for i in range(300)], tag="a")
    b = _dataset([{"input": f"b{i}", "output": ""} for i in range(300)], tag="b")
    a.to_parquet(str(tmp_path / "a.parquet"))
    b.to_parquet(str(tmp_path / "b.parquet"))
    spec = f"{tmp_path / 'a.parquet'},{tmp_path / 'b.parquet'}"
    blended = load_dataset_spec(spec, probs="0.25,0.75", seed=1)
    share_a = list(blended["src"]).count("a") / len(blended)
    assert 0.18 < share_a < 0.32
    # all_exhausted: every row of the rarer source appears at least once
    assert {x for x, s in zip(blended["input"], blended["src"], strict=True) if s == "a"} == set(a["input"])
    assert blended.to_list() == load_dataset_spec(spec, probs="0.25,0.75", seed=1).to_list()
    assert blended.to_list() != load_dataset_spec(spec, probs="0.25,0.75", seed=2).to_list()


def test_concat_without_probs_and_max_samples(tmp_path):
    p1, p2 = _write_jsonl(tmp_path / "a.jsonl", ROWS[:10]), _write_jsonl(tmp_path / "b.jsonl", ROWS[10:])
    assert load_dataset_spec(f"{p1}, {p2}").to_list() == ROWS  # no probs: concatenated in order
    assert load_dataset_spec(str(p1), max_samples=3).to_list() == ROWS[:3]
    assert len(load_dataset_spec(f"{p1},{p2}", max_samples=4)) == 4


@pytest.mark.parametrize(
    ("probs", "match"),
    [("0.5", r"--dataset_probs has 1 value.*2 source"), ("0.5,0.6", "sum to 1"), ("a,b", "numbers")],
)
def test_bad_probs(tmp_path, probs, match):
    p1, p2 = _write_jsonl(tmp_path / "a.jsonl", ROWS), _write_jsonl(tmp_path / "b.jsonl", ROWS)
    with pytest.raises(DataError, match=match):
        load_dataset_spec(f"{p1},{p2}", probs=probs)


def test_missing_file_and_bad_extension(tmp_path):
    with pytest.raises(DataError, match=r"not found: .*nope\.jsonl"):
        load_dataset_spec(str(tmp_path / "nope.jsonl"))
    bad = tmp_path / "data.txt"
    bad.write_text("hello")
    with pytest.raises(DataError, match=r"unsupported .*'\.txt'.*data\.txt"):
        load_dataset_spec(str(bad))


def test_malformed_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(
        '{"input": "a", "output": "b"}\n{"input": "c", "output": "d"}\n\n{"input": "e", "output": \n'
    )
    with pytest.raises(DataError) as info:
        load_dataset_spec(str(path))
    assert "broken.jsonl" in str(info.value) and "line 4" in str(info.value)


def test_malformed_json_array_names_line(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('[\n  {"input": "a"},\n  {"input": "b" "c"}\n]\n')
    with pytest.raises(DataError, match=r"broken\.json: line 3"):
        load_dataset_spec(str(path))


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.json", "empty.csv", "empty.parquet"])
def test_empty_file(tmp_path, name):
    path = tmp_path / name
    if name.endswith(".parquet"):
        _dataset().select([]).to_parquet(str(path))
    elif name.endswith(".csv"):
        path.write_text("input,output\n")
    else:
        path.write_text("")
    with pytest.raises(DataError, match=rf"{name}.* (empty|no rows)"):
        load_dataset_spec(str(path))


def test_corrupt_parquet_names_file(tmp_path):
    path = tmp_path / "corrupt.parquet"
    path.write_bytes(b"not a parquet file at all")
    with pytest.raises(DataError, match=r"cannot read parquet file .*corrupt\.parquet"):
        load_dataset_spec(str(path))


def test_require_keys_names_key_source_and_columns(tmp_path):
    ds = load_dataset_spec(str(_write_jsonl(tmp_path / "d.jsonl", ROWS)))
    require_keys(ds, ["input", None], "d.jsonl")
    with pytest.raises(DataError, match=r"'question' not found in d\.jsonl.*\['input', 'output'\]"):
        require_keys(ds, ["question"], "d.jsonl")


def test_unknown_hub_name_fails_fast_offline(monkeypatch):
    monkeypatch.setattr(loading, "_hub_reachable", lambda timeout=3.0: False)
    start = time.monotonic()
    with pytest.raises(DataError, match="neither an existing local path nor loadable.*offline"):
        load_dataset_spec("no-such-org/no-such-dataset")
    assert time.monotonic() - start < 5


def test_blending_sources_with_different_columns(tmp_path, caplog):
    p1 = _write_jsonl(tmp_path / "a.jsonl", ROWS)
    p2 = _write_jsonl(tmp_path / "b.jsonl", [{"question": "x"}])
    blended = load_dataset_spec(f"{p1},{p2}", probs="0.5,0.5")
    assert "different columns" in caplog.text and "b.jsonl: ['question']" in caplog.text
    assert set(blended.column_names) == {"input", "output", "question"}
    p3 = _write_jsonl(tmp_path / "c.jsonl", [{"input": 1, "output": "y"}])
    with pytest.raises(DataError, match=r"cannot blend .*a\.jsonl: \['input', 'output'\]; .*c\.jsonl"):
        load_dataset_spec(f"{p1},{p3}", probs="0.5,0.5")


def test_local_files_load_without_datasets_progress_bars(tmp_path, capfd):
    """At tidal's default log level, reading a local file prints no "Generating train split" bar (start-up
    noise); the bars stay enabled for everything else afterwards."""
    import datasets

    from tidal.data.loading import load_source

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.enable_progress_bars()  # as in a user's shell (the test session may have them off)
    try:
        for name in ("quiet", "loud"):
            path = tmp_path / f"{name}.jsonl"
            path.write_text("".join(f'{{"prompt": "{name}{i}"}}\n' for i in range(3)))
            capfd.readouterr()
            if name == "quiet":
                assert len(load_source(str(path))) == 3
                assert "Generating" not in capfd.readouterr().err
                assert datasets.is_progress_bar_enabled()
            else:  # the check can see a bar: without tidal's guard, datasets prints one
                datasets.load_dataset("json", data_files=str(path), split="train")
                assert "Generating" in capfd.readouterr().err
    finally:
        if not was_enabled:
            datasets.disable_progress_bars()
