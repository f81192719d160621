"""A full disk never loses the trained model (issue #30 §4): a ``--save_path`` without room for the model
is refused before training, and a final export that has no room (or runs out of it while writing)
goes to a rescue folder under the temporary folder, named in the one-line error. On a real 1 MiB tmpfs
where this process may mount one (root), else skipped; the free-space check is also faked for CPU-only
machines that cannot mount."""

from __future__ import annotations

import json
import subprocess
import tempfile

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tidal.checkpoint import CheckpointError, hf_export, save_hf_model, space
from tidal.cli.train_sft import main as sft_main
from tidal.distributed.world import World

WORLD = World()


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (the tiny model needs ~6 MiB); skipped where mounting is not permitted."""
    folder = tmp_path / "small"
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


@pytest.fixture
def spare(tmp_path, monkeypatch):
    """The temporary folder rescue copies go to."""
    folder = tmp_path / "spare"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


@pytest.fixture
def tiny_causal(tiny_qwen2):
    return AutoModelForCausalLM.from_pretrained(tiny_qwen2), AutoTokenizer.from_pretrained(tiny_qwen2)


def assert_rescued(err: CheckpointError, spare, model) -> None:
    (rescued,) = spare.iterdir()
    assert rescued.name.startswith("tidal-rescue-final-")
    assert f": the trained model was saved to {rescued} instead; move it where it belongs" in str(err)
    copy = AutoModelForCausalLM.from_pretrained(rescued)
    for (name, a), (_, b) in zip(model.state_dict().items(), copy.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_final_export_without_room_is_rescued(tiny_causal, small_disk, spare):
    model, tokenizer = tiny_causal
    with pytest.raises(CheckpointError) as err:
        save_hf_model(model, tokenizer, small_disk / "final", WORLD, rescue=True)
    assert str(err.value).startswith(f"{small_disk / 'final'} has 1.0 MiB free, the model needs ~")
    assert_rescued(err.value, spare, model)
    assert list(small_disk.iterdir()) == []  # nothing half-written on the full disk


def test_disk_filling_up_during_the_final_export_is_rescued(tiny_causal, small_disk, spare, monkeypatch):
    """The free space looked fine (another process filled the disk later): the write's ENOSPC rescues."""
    model, tokenizer = tiny_causal
    checked = space.space_problem
    monkeypatch.setattr(
        hf_export, "space_problem", lambda p, n: None if small_disk in p.parents else checked(p, n)
    )
    with pytest.raises(CheckpointError) as err:
        save_hf_model(model, tokenizer, small_disk / "final", WORLD, rescue=True)
    assert str(err.value).startswith(f"no space left on {small_disk / 'final'} (the model needs ~")
    assert_rescued(err.value, spare, model)
    assert list(small_disk.iterdir()) == []


def test_no_room_anywhere_says_the_model_could_not_be_saved(tiny_causal, tmp_path, spare, monkeypatch):
    model, tokenizer = tiny_causal
    monkeypatch.setattr(space, "free_bytes", lambda path: 0)  # every disk full (no mount needed)
    with pytest.raises(
        CheckpointError, match=r"and .*spare has no room for it either: the trained model could not"
    ):
        save_hf_model(model, tokenizer, tmp_path / "final", WORLD, rescue=True)
    with pytest.raises(CheckpointError, match=r"^not enough space to save the model: .* has 0.0 MiB free"):
        save_hf_model(model, tokenizer, tmp_path / "copy", WORLD)  # a checkpoint's HF copy: no rescue


def test_training_is_refused_when_save_path_has_no_room(tiny_qwen2, small_disk, tmp_path, capsys):
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}>", "output": str(i)}) + "\n" for i in range(8)))
    with pytest.raises(SystemExit) as exc:
        sft_main(["--pretrain", str(tiny_qwen2), "--dataset", str(data), "--train_batch_size", "4",
                  "--micro_train_batch_size", "4", "--save_path", str(small_disk / "final")])  # fmt: skip
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--save_path {small_disk / 'final'} has 1.0 MiB free, the model needs ~" in err
    assert "free space there, or pass another --save_path" in err
    assert not (small_disk / "final" / "model.safetensors").exists()
