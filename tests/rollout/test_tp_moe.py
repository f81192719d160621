"""Tensor-parallel MoE engines (``EngineConfig.tp_size`` 2: two CPU processes over gloo) against one process,
for Qwen3-MoE, Mixtral and Qwen2-MoE (shared expert): each rank holds every expert's slice of the
intermediate size. Same greedy tokens and log-probs within 1e-5 on a mixed-length batch, the same seeded
samples, the same recorded experts (router replay; rank 0 records), and ``update_weights`` from a trainer's
stacked expert tensors equal to a fresh load; a size that does not divide an expert's intermediate size
is refused in one line before any process starts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from tests.rollout.reference import PROMPTS, cpu_config
from tidal.rollout import LLMEngine, SamplingParams
from tidal.rollout.models.loader import build_decoder, iter_checkpoint, tp_layout_problem
from tidal.rollout.models.parallel import TPGroup
from tidal.testing.tiny import tiny_config

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=4, n=2, seed=7)
SHORT = SamplingParams(temperature=0.0, max_new_tokens=4)  # after a weight sync (each TP step is slow on CPU)
# Qwen3-MoE with a dense layer (mlp_only_layers), Mixtral (float32 routing weights), Qwen2-MoE (shared
# expert, reduced once with the routed experts; dense layers every other one). 501: an uneven vocabulary.
FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")


def config(tp_size: int):
    return cpu_config(max_model_len=96, block_size=4, tp_size=tp_size, record_routing=True)


def assert_same_outputs(reference, outputs) -> None:
    for ref, out in zip(reference, outputs, strict=True):
        for a, b in zip(ref.outputs, out.outputs, strict=True):
            assert a.token_ids == b.token_ids
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
            assert torch.equal(torch.as_tensor(a.routed_experts), torch.as_tensor(b.routed_experts))


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_moe_matches_one_process_and_syncs_weights(tiny_model, family):
    """TP=2 equals TP=1 (tokens, log-probs, recorded experts); then a trainer's weights (transformers'
    stacked ``experts.gate_up_proj`` / ``down_proj``) reach both ranks' shards: TP=2 equals TP=1 loaded
    from the same checkpoint."""
    old, new = tiny_model(family, vocab_size=501), tiny_model(family, seed=1, vocab_size=501)
    tp = LLMEngine(old, config(2))
    try:
        single = LLMEngine(old, config(1))
        assert_same_outputs(single.generate(PROMPTS, GREEDY), tp.generate(PROMPTS, GREEDY))
        assert_same_outputs(single.generate(PROMPTS[:2], SAMPLED), tp.generate(PROMPTS[:2], SAMPLED))
        trainer = AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32)
        named = dict(trainer.named_parameters())
        assert any(name.endswith("experts.gate_up_proj") for name in named)  # stacked, not per expert
        assert tp.update_weights(named.items()) > 0
        reference = LLMEngine(new, config(1)).generate(PROMPTS[1:3], SHORT)
        assert_same_outputs(reference, tp.generate(PROMPTS[1:3], SHORT))
    finally:
        tp.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_rank_shards_are_slices_of_the_full_experts(tiny_model, family):
    """Loading a checkpoint (per-expert tensors) as rank r of 2 keeps exactly that rank's slice of every
    expert: gate and up rows, down columns; the router is whole on every rank (no process group needed)."""
    path = tiny_model(family, vocab_size=501)
    hf = tiny_config(family, vocab_size=501)
    full = build_decoder(hf, iter_checkpoint(path), 32, torch.float32, torch.device("cpu"))
    block = next(layer.mlp for layer in full.model.layers if hasattr(layer.mlp, "experts"))
    name = next(n for n, m in full.named_modules() if m is block)
    gate, up = block.experts.gate_up_proj.chunk(2, dim=1)
    inter = gate.shape[1]
    for rank in range(2):
        shard = build_decoder(
            hf, iter_checkpoint(path), 32, torch.float32, torch.device("cpu"), TPGroup(rank, 2)
        )
        mine = shard.get_submodule(name)
        rows = slice(rank * inter // 2, (rank + 1) * inter // 2)
        assert torch.equal(mine.experts.gate_up_proj, torch.cat([gate[:, rows], up[:, rows]], dim=1))
        assert torch.equal(mine.experts.down_proj, block.experts.down_proj[:, :, rows])
        assert torch.equal(mine.gate.weight, block.gate.weight)


class CountingGroup:
    """A stand-in process group: counts all-reduces (the sum of one rank is its own tensor)."""

    def __init__(self):
        self.all_reduces = 0

    def allreduce(self, tensors):
        self.all_reduces += 1
        return self

    def wait(self):
        return None


def test_qwen2_moe_block_reduces_once_with_its_shared_expert():
    """Rank 0 of 2 of a Qwen2-MoE block: the routed experts' and the shared expert's partial sums go out
    in one all-reduce (the shared expert's down projection defers its own)."""
    from tidal.rollout.models.moe import SparseMoE
    from tidal.rollout.models.qwen2_moe import Qwen2MoeForCausalLM

    args = Qwen2MoeForCausalLM.args_from_hf_config(tiny_config("qwen2_moe"))
    group = CountingGroup()
    args.tp = TPGroup(0, 2, group)
    torch.manual_seed(0)
    block = SparseMoE(args)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.1)
    assert block.experts.down_proj.shape[-1] == args.moe.intermediate_size // 2
    with torch.no_grad():
        block(torch.randn(5, args.hidden_size))
    assert group.all_reduces == 1


@pytest.mark.parametrize(
    ("family", "overrides", "message"),
    [
        ("qwen3_moe", {"moe_intermediate_size": 63}, "tensor-parallel size 2 does not divide moe_intermediate_size=63"),
        ("mixtral", {"intermediate_size": 63}, "tensor-parallel size 2 does not divide intermediate_size=63"),
        ("qwen2_moe", {"shared_expert_intermediate_size": 63}, "does not divide shared_expert_intermediate_size=63"),
    ],
)  # fmt: skip
def test_moe_layout_refused_before_start(tiny_model, family, overrides, message):
    assert message in tp_layout_problem(tiny_config(family, **overrides), 2)
    with pytest.raises(ValueError, match=message):
        LLMEngine(tiny_model(family, **overrides), config(2))


def test_cli_moe_layout_exits_2_naming_the_flag(tiny_model, tmp_path, capsys):
    """``tidal generate --tp_size 2`` and ``tidal ppo --vllm_tensor_parallel_size 2`` on a Qwen3-MoE whose
    expert size 2 does not divide: one line naming the flag and the numbers, before any model loads."""
    from tests.rollout.test_tp_generate import generate
    from tidal.cli.train_ppo import main as ppo_main
    from tidal.testing import AdditionTask

    model = tiny_model("qwen3_moe", moe_intermediate_size=63)
    prompts = AdditionTask(seed=3).write_jsonl(tmp_path / "prompts.jsonl", 1)
    expected = "tensor-parallel size 2 does not divide moe_intermediate_size=63"
    with pytest.raises(SystemExit) as exc:
        generate(model, prompts, tmp_path / "x.jsonl", "--tp_size", "2")
    assert exc.value.code == 2
    assert f"--tp_size 2: {expected}" in capsys.readouterr().err
    ppo_flags = ["--pretrain", str(model), "--prompt_data", str(prompts), "--input_key", "prompt",
                 "--vllm_tensor_parallel_size", "2", "--save_path", str(tmp_path / "final")]  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        ppo_main(ppo_flags)
    assert exc.value.code == 2
    assert f"--vllm_tensor_parallel_size 2: {expected}" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists() and not (tmp_path / "final").exists()


# --------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("tp_size", [2, 4, 8])
def test_fused_moe_on_shards_sums_to_the_experts_at_qwen3_30b_shapes(tp_size):
    """The fused Triton experts run on each rank's slice of Qwen3-30B-A3B's experts (hidden 2048, 128
    experts, top-8, intermediate 768 / ``tp_size``: 96 at 8, not a multiple of the tiles); the bf16
    partial sums, added in bf16 as the all-reduce does, match the float32 experts as the whole does
    (bf16 tolerance of ``test_triton_moe``)."""
    from tidal.rollout.kernels.triton_moe import fused_expert_forward
    from tidal.rollout.models import moe

    hidden, num_experts, top_k, inter, tokens = 2048, 128, 8, 768, 256
    gen = torch.Generator(device="cuda").manual_seed(tp_size)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").bfloat16()
    gate_up = (
        torch.randn(num_experts, 2 * inter, hidden, generator=gen, device="cuda") / hidden**0.5
    ).bfloat16()
    down = (torch.randn(num_experts, hidden, inter, generator=gen, device="cuda") / inter**0.5).bfloat16()
    logits = torch.randn(tokens, num_experts, generator=gen, device="cuda")
    weights, ids = moe.route(logits, top_k, renormalize=True, weights_in_model_dtype=False)
    exact = moe.unfused_expert_forward(x.float(), gate_up.float(), down.float(), weights, ids, F.silu)
    gate, up = gate_up.chunk(2, dim=1)
    per = inter // tp_size
    total = torch.zeros_like(x)
    for rank in range(tp_size):
        rows = slice(rank * per, (rank + 1) * per)
        shard_gate_up = torch.cat([gate[:, rows], up[:, rows]], dim=1).contiguous()
        total += fused_expert_forward(x, shard_gate_up, down[:, :, rows].contiguous(), weights, ids)
    whole = fused_expert_forward(x, gate_up, down, weights, ids)
    rel = ((total.float() - exact).norm() / exact.norm()).item()
    assert rel < 1e-2
    assert rel < 2 * ((whole.float() - exact).norm() / exact.norm()).item() + 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_moe_engine_on_two_gpus(tiny_model):
    """A float32 Qwen3-MoE engine over 2 GPUs (NCCL, fused experts on each shard) gives one GPU's greedy
    tokens and log-probs within 1e-4; rank 0 records every token's experts."""
    from tidal.rollout import EngineConfig

    path = tiny_model("qwen3_moe", vocab_size=501, logit_scale=4.0)  # peaked: no near-ties for greedy

    def cuda_config(tp_size: int):
        return EngineConfig(
            device="cuda", dtype="float32", max_model_len=96, tp_size=tp_size, record_routing=True
        )

    tp = LLMEngine(path, cuda_config(2))
    try:
        reference = LLMEngine(path, cuda_config(1)).generate(PROMPTS, GREEDY)
        outputs = tp.generate(PROMPTS, GREEDY)
        for ref, out, prompt in zip(reference, outputs, PROMPTS, strict=True):
            a, b = ref.outputs[0], out.outputs[0]
            assert a.token_ids == b.token_ids
            assert max(abs(p - q) for p, q in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
            assert b.routed_experts.shape[0] == len(prompt) + len(b.token_ids) - 1
    finally:
        tp.close()
