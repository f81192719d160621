"""A 2-process (FSDP2, gloo) HF export equals the 1-process one: same safetensors keys (tied
embeddings written once) and values."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tidal.checkpoint import save_hf_model
from tidal.distributed.world import World

EXPORT = textwrap.dedent(
    """
    import sys, torch
    from transformers import AutoModelForCausalLM
    from tidal.checkpoint import save_hf_model
    from tidal.config import DistributedConfig
    from tidal.distributed import init_world, parallelize, shutdown

    torch.set_num_threads(1)
    world = init_world()
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
    model = parallelize(model, DistributedConfig(zero_stage=3), world, torch.float32)
    save_hf_model(model, None, sys.argv[2], world)
    shutdown(world)
    """
)


def test_two_process_export_matches_one_process_with_tied_embeddings(tiny_qwen2, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    assert model.config.tie_word_embeddings
    save_hf_model(model, None, tmp_path / "one", World())
    script = tmp_path / "export.py"
    script.write_text(EXPORT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script), str(tiny_qwen2), str(tmp_path / "two")]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    one = load_file(tmp_path / "one" / "model.safetensors")
    two = load_file(tmp_path / "two" / "model.safetensors")
    assert sorted(two) == sorted(one) and "lm_head.weight" not in two
    for name, tensor in one.items():
        torch.testing.assert_close(two[name], tensor, rtol=0, atol=0)
