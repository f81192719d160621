"""Faults while saving lose nothing saved before: a full disk (injected ENOSPC) in a checkpoint or
the final export, ``kill -9`` in the middle of a checkpoint write, and NaN weights (refused)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.checkpoint.parts import make_part
from tidal.checkpoint import (
    CheckpointError,
    LoopState,
    hf_export,
    latest_checkpoint,
    load_checkpoint,
    resumable,
    save_hf_model,
)
from tidal.distributed.world import World

WORLD = World()


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_full_disk_during_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    resumable.save_checkpoint(tmp_path, {"model": make_part(1)}, LoopState(2), WORLD, meta={"lineage": "a"})
    monkeypatch.setattr(resumable.torch, "save", no_space)
    with pytest.raises(CheckpointError) as err:
        resumable.save_checkpoint(
            tmp_path, {"model": make_part(2)}, LoopState(4), WORLD, meta={"lineage": "a"}
        )
    monkeypatch.undo()
    assert str(err.value) == f"no space left on {tmp_path}"
    assert not list(tmp_path.glob(".tmp_*")) and not (tmp_path / "global_step_4").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "global_step_2"
    part = make_part(9)
    load_checkpoint(tmp_path / "global_step_2", {"model": part}, WORLD)
    torch.testing.assert_close(part.model.weight, make_part(1).model.weight, rtol=0, atol=0)


@pytest.fixture
def tiny_causal(tiny_qwen2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_qwen2), AutoTokenizer.from_pretrained(tiny_qwen2)


def test_full_disk_during_export_keeps_the_previous_export(tiny_causal, tmp_path, monkeypatch):
    model, tokenizer = tiny_causal
    out = tmp_path / "final"
    (out / "run").mkdir(parents=True)
    (out / "run" / "metrics.jsonl").write_text("{}\n")  # the run folder lives inside --save_path
    save_hf_model(model, tokenizer, out, WORLD)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    original = type(model).save_pretrained

    def config_then_full_disk(self, folder, **kwargs):
        Path(folder, "config.json").write_text("{}")  # like transformers: config first, weights next
        no_space()

    monkeypatch.setattr(type(model), "save_pretrained", config_then_full_disk)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    with pytest.raises(CheckpointError) as err:
        save_hf_model(model, tokenizer, out, WORLD)
    monkeypatch.setattr(type(model), "save_pretrained", original)
    assert str(err.value) == f"no space left on {out}"
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert (out / "run" / "metrics.jsonl").exists() and not list(tmp_path.glob(".tmp_*"))


def test_nan_weights_are_never_saved(tiny_causal, tmp_path):
    model, tokenizer = tiny_causal
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(CheckpointError, match=r"refusing to save .*NaN or inf \(model.layers.0.mlp.up_proj"):
        save_hf_model(model, tokenizer, tmp_path / "final", WORLD)
    assert not (tmp_path / "final").exists()
    part = make_part(1)
    with torch.no_grad():
        part.model.bias[0] = float("inf")
    with pytest.raises(CheckpointError, match="refusing to save"):
        resumable.save_checkpoint(tmp_path / "ckpt", {"model": part}, LoopState(1), WORLD)
    assert not (tmp_path / "ckpt" / "global_step_1").exists()


def test_install_replaces_stale_shards_but_keeps_other_files(tmp_path):
    out, tmp = tmp_path / "out", tmp_path / ".tmp_out"
    out.mkdir()
    tmp.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json", "notes.txt"):
        (out / name).write_text("old")
    (tmp / "model.safetensors").write_text("new")
    (tmp / "config.json").write_text("new")
    hf_export._install(tmp, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    assert not tmp.exists()


KILLED_SAVE = textwrap.dedent(
    """
    import os, signal, sys, torch
    from torch import nn
    from tidal.checkpoint import resumable, LoopState
    from tidal.distributed.world import World

    class Part:
        def __init__(self, seed):
            torch.manual_seed(seed)
            self.model = nn.Linear(4, 3)
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0)

    path = sys.argv[1]
    resumable.save_checkpoint(path, {"model": Part(1)}, LoopState(2), World(), meta={"lineage": "a"})

    def killed(*args, **kwargs):  # the shards are written; die before the trainer state and rename
        os.kill(os.getpid(), signal.SIGKILL)

    resumable.torch.save = killed
    resumable.save_checkpoint(path, {"model": Part(2)}, LoopState(4), World(), meta={"lineage": "a"})
    """
)


def test_kill_9_during_a_checkpoint_write_leaves_the_previous_one_loadable(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(ckpt)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)  # fmt: skip
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert (ckpt / ".tmp_global_step_4" / "model_optim").is_dir()  # the half-written save
    assert (ckpt / "latest").read_text() == "global_step_2"
    assert latest_checkpoint(ckpt) == ckpt / "global_step_2"
    part = make_part(9)
    loop, _ = load_checkpoint(ckpt / "global_step_2", {"model": part}, WORLD)
    assert loop.global_step == 2
    torch.testing.assert_close(part.model.weight, make_part(1).model.weight, rtol=0, atol=0)
    # the next save clears what the killed one left behind
    resumable.save_checkpoint(ckpt, {"model": make_part(3)}, LoopState(6), WORLD, meta={"lineage": "a"})
    assert not list(ckpt.glob(".tmp_*"))
    assert json.loads((ckpt / "global_step_6" / "meta.json").read_text())["global_step"] == 6


def test_export_writes_tied_embeddings_once(tiny_causal, tmp_path):
    model, tokenizer = tiny_causal
    assert model.config.tie_word_embeddings
    save_hf_model(model, tokenizer, tmp_path / "one", WORLD)
    assert "lm_head.weight" not in load_file(tmp_path / "one" / "model.safetensors")
