"""Ring attention and plain data parallelism under each FSDP2 ZeRO stage (issue #30): SFT over 2 gloo
processes trains the parameters one process trains, within 1e-4 after 3 steps, over the matrix
``--ring_attn_size`` {1, 2} × ``--zero_stage`` {2, 3} × tied/untied embeddings × packed/padded rows ×
``--gradient_checkpointing`` (ring attention needs packed rows, so the ring's padded column is absent).

Under ``--zero_stage 3`` FSDP2 frees the gathered weights after forward and gathers them again in a hook
on the root module's outputs; the ring forward's LM head used to hand its log-probs to the loss beside
that output, so backward reached the chunked head with the weight's storage freed (``setStorage ... out
of bounds for storage of size 0``). All 2-process runs share one launch (``ring_runner.py``); one
process needs one reference per (embeddings, packing): its ZeRO stage is a no-op and checkpointing
recomputes the same values."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tidal.cli import train_sft
from tidal.models.logprob_head import chunked_logprobs
from tidal.testing import AdditionTask, build_tiny_model
from tidal.trainers.sft import run_sft

RUNNER = Path(__file__).with_name("ring_runner.py")
# Smaller than tiny_qwen2 (the run count is what costs here); Qwen2 ties its embeddings by default.
SHAPES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


@dataclass(frozen=True)
class Setup:
    ring: int
    zero: int
    tied: bool
    packing: bool
    checkpointing: bool

    @property
    def name(self) -> str:
        return (
            f"ring{self.ring}-zero{self.zero}-{'tied' if self.tied else 'untied'}-"
            f"{'packed' if self.packing else 'padded'}{'-ckpt' if self.checkpointing else ''}"
        )

    @property
    def reference(self) -> str:
        return f"one-{'tied' if self.tied else 'untied'}-{'packed' if self.packing else 'padded'}"


MATRIX = [
    Setup(ring, zero, tied, packing, ckpt)
    for ring in (1, 2)
    for zero in (2, 3)
    for tied in (True, False)
    for packing in (True, False)
    for ckpt in (False, True)
    if packing or ring == 1
]


def sft_flags(model: Path, data: Path, out: Path, packing: bool, *extra: str) -> list[str]:
    return [
        "--pretrain", str(model), "--dataset", str(data), "--input_key", "prompt", "--output_key", "answer",
        "--max_len", "64", "--train_batch_size", "4", "--micro_train_batch_size", "2", "--max_samples", "12",
        "--max_epochs", "1",
        "--learning_rate", "2e-3", "--lr_warmup_ratio", "0", "--seed", "5",
        "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"),
        *(["--packing_samples"] if packing else []), *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, ranks) -> Path:
    """The one-process references, then every setup of ``MATRIX`` in one 2-process launch."""
    folder = tmp_path_factory.mktemp("ring_zero3")
    models = {
        tied: build_tiny_model(folder / f"model-{tied}", "qwen2", seed=0, tie_word_embeddings=tied, **SHAPES)
        for tied in (True, False)
    }
    data = AdditionTask(digits=3, seed=4).write_jsonl(folder / "sft.jsonl", 16)
    for setup in {s.reference: s for s in MATRIX}.values():
        run_sft(
            train_sft.parse_run(sft_flags(models[setup.tied], data, folder / setup.reference, setup.packing))
        )
    specs = [
        {
            "kind": "sft",
            "out": str(folder / f"{s.name}.json"),
            "argv": sft_flags(
                models[s.tied],
                data,
                folder / s.name,
                s.packing,
                "--ring_attn_size",
                str(s.ring),
                "--zero_stage",
                str(s.zero),
                *(["--gradient_checkpointing"] if s.checkpointing else []),
            ),  # fmt: skip
        }
        for s in MATRIX
    ]
    (folder / "runs.json").write_text(json.dumps(specs))
    ranks.launch(RUNNER, folder / "runs.json")  # 2 processes (tests/trainers/conftest.py)
    return folder


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "model.safetensors"))


@pytest.mark.parametrize("setup", MATRIX, ids=lambda s: s.name)
def test_two_processes_train_the_one_process_parameters(matrix, setup):
    report = json.loads((matrix / f"{setup.name}.json").read_text())
    assert len(report["history"]) == 3
    assert (report["ring_layers"] > 0) == (setup.ring > 1)  # the attention did (not) run as the ring
    one, two = weights(matrix / setup.reference), weights(matrix / setup.name)
    assert one.keys() == two.keys()
    start = weights_at_start(matrix, setup.tied)
    for key, expected in one.items():
        assert (expected - start[key]).abs().max() > 1e-3, key  # the steps did move every tensor
        assert torch.allclose(two[key], expected, rtol=0, atol=1e-4), (key, (two[key] - expected).abs().max())


def weights_at_start(folder: Path, tied: bool) -> dict[str, torch.Tensor]:
    return load_file(str(folder / f"model-{tied}" / "model.safetensors"))


def test_a_head_weight_freed_before_backward_fails_with_one_line():
    """Were the log-probs ever read beside the head's output again, backward names the cause."""
    head = torch.nn.Linear(8, 16, bias=False)
    hidden = torch.randn(5, 8, requires_grad=True)
    logp, _ = chunked_logprobs(hidden, head.weight, None, torch.arange(5), chunk_size=4)
    head.weight.untyped_storage().resize_(0)  # what FSDP2's reshard after forward does
    with pytest.raises(RuntimeError, match="the LM head's weight was freed"):
        logp.sum().backward()
