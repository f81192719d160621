"""The engine's MoE block (``tidal/rollout/models/moe.py``) against transformers' routers and experts, and
its loader on per-expert checkpoints and stacked trainer parameters.

Greedy tokens and log-probs of the MoE families against ``transformers.generate`` run in
``test_engine_vs_hf.py`` (parametrised over the registry); these tests pin the parts one by one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.rollout.reference import PROMPTS, cpu_config, hf_greedy, hf_logprobs
from tidal.rollout import LLMEngine, SamplingParams
from tidal.rollout.models import moe
from tidal.rollout.models.loader import build_decoder, iter_checkpoint
from tidal.rollout.models.registry import model_class
from tidal.testing.tiny import tiny_config


def _naive_moe(x, gate_up, down, weights, ids):
    """Token by token, expert by expert, in float64: the definition the sorted path must reproduce."""
    x, gate_up, down, weights = x.double(), gate_up.double(), down.double(), weights.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            gate, up = (gate_up[ids[t, k]] @ x[t]).chunk(2)
            out[t] += weights[t, k] * (down[ids[t, k]] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_expert_forward_is_the_weighted_sum_of_the_selected_experts(top_k):
    torch.manual_seed(0)
    tokens, hidden, inter, experts = 11, 16, 8, 6
    x = torch.randn(tokens, hidden)
    gate_up, down = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter)
    # Expert 5 is never chosen (an empty slice) and expert 0 by every token.
    ids = torch.stack(
        [
            torch.cat([torch.zeros(1, dtype=torch.long), 1 + torch.randperm(4)[: top_k - 1]])
            for _ in range(tokens)
        ]
    )
    weights = torch.rand(tokens, top_k)
    got = moe.expert_forward(x, gate_up, down, weights, ids, F.silu)
    assert got.dtype == torch.float32 and got.shape == (tokens, hidden)
    torch.testing.assert_close(got.double(), _naive_moe(x, gate_up, down, weights, ids), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(
    ("family", "dtype"),
    [("qwen3_moe", torch.float32), ("qwen3_moe", torch.bfloat16), ("mixtral", torch.bfloat16)],
)
def test_route_matches_the_hf_router(family, dtype):
    """Softmax in float32, top-k, renormalisation; Qwen rounds the weights to the model dtype, Mixtral
    keeps them in float32 (visible in bf16)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = tiny_config(family)
    router = (Qwen3MoeTopKRouter if family == "qwen3_moe" else MixtralTopKRouter)(config).to(dtype)
    torch.manual_seed(1)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(9, config.hidden_size, dtype=dtype)
    logits, want_weights, want_ids = router(x)
    args = model_class(family).args_from_hf_config(config).moe
    weights, ids = moe.route(logits, args.top_k, args.renormalize, args.weights_in_model_dtype)
    assert weights.dtype == want_weights.dtype == (dtype if family == "qwen3_moe" else torch.float32)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)


def test_dense_and_sparse_layers_follow_the_config():
    qwen3 = model_class("qwen3_moe").args_from_hf_config(tiny_config("qwen3_moe", mlp_only_layers=[0, 2]))
    assert qwen3.moe.sparse_layers == (False, True, False, True)
    qwen2 = model_class("qwen2_moe").args_from_hf_config(tiny_config("qwen2_moe", decoder_sparse_step=2))
    assert qwen2.moe.sparse_layers == (False, True, False, True)
    assert qwen2.moe.shared_expert_intermediate_size == 128 and not qwen2.moe.renormalize
    mixtral = model_class("mixtral").args_from_hf_config(tiny_config("mixtral"))
    assert mixtral.moe.sparse_layers == (True,) * 4 and mixtral.moe.renormalize

    with torch.device("meta"):
        model = model_class("qwen3_moe")(qwen3)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["GatedMLP", "SparseMoE", "GatedMLP", "SparseMoE"]
    assert tuple(model.model.layers[1].mlp.experts.gate_up_proj.shape) == (8, 2 * 64, 192)
    assert tuple(model.model.layers[1].mlp.experts.down_proj.shape) == (8, 192, 64)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_stacked_trainer_parameters_load_like_the_per_expert_checkpoint(family, tiny_model, hf_model):
    """Checkpoint folders hold one tensor per expert (Mixtral: ``block_sparse_moe.experts.e.w1``); a
    transformers model's ``named_parameters()`` (weight sync) holds the stacked ``experts.gate_up_proj``.
    Both must fill every engine parameter with the same values."""
    path = tiny_model(family)
    hf = hf_model(path)
    names = set(load_file(str(path / "model.safetensors")))
    assert any(".experts.0." in name for name in names)
    assert any(name.endswith("experts.gate_up_proj") for name, _ in hf.named_parameters())
    build = lambda weights: build_decoder(hf.config, weights, 64, torch.float32, torch.device("cpu"))  # noqa: E731
    from_files, from_trainer = build(iter_checkpoint(path)), build(hf.named_parameters())
    for (name, a), (_, b) in zip(
        from_files.state_dict().items(), from_trainer.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_a_checkpoint_missing_one_expert_is_refused(tiny_model, hf_model, tmp_path):
    path = tiny_model("qwen3_moe")
    weights = {
        k: v for k, v in load_file(str(path / "model.safetensors")).items() if ".experts.5.up_proj" not in k
    }
    save_file(weights, str(tmp_path / "model.safetensors"))
    config = hf_model(path).config
    with pytest.raises(
        ValueError, match=r"checkpoint is missing 3 weights, e.g. \['model.layers.0.mlp.experts"
    ):
        build_decoder(config, iter_checkpoint(tmp_path), 64, torch.float32, torch.device("cpu"))


def test_engine_weight_sync_from_a_trained_moe_policy(tiny_model, hf_model):
    """``LLMEngine.update_weights(policy.named_parameters())`` with stacked experts: the engine then
    generates what the updated policy generates."""
    path = tiny_model("qwen3_moe")
    engine = LLMEngine(path, cpu_config(max_model_len=96, block_size=4))
    policy = hf_model(tiny_model("qwen3_moe", seed=3))
    engine.update_weights(policy.named_parameters())
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    for prompt, out in zip(PROMPTS[:2], engine.generate(PROMPTS[:2], params), strict=True):
        assert out.outputs[0].token_ids == hf_greedy(policy, prompt, 8)
        expected = hf_logprobs(policy, prompt, out.outputs[0].token_ids)
        torch.testing.assert_close(torch.tensor(out.outputs[0].logprobs), expected, atol=1e-4, rtol=0)


def test_mixtral_sliding_window_matches_hf(tiny_model, hf_model):
    # Prompt and output both longer than the window, so the window actually masks keys.
    path = tiny_model("mixtral", sliding_window=8)
    engine = LLMEngine(path, cpu_config(max_model_len=128, block_size=4))
    hf = hf_model(path)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    for prompt, out in zip(PROMPTS[1:3], engine.generate(PROMPTS[1:3], params), strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 12)
        expected = hf_logprobs(hf, prompt, out.outputs[0].token_ids)
        torch.testing.assert_close(torch.tensor(out.outputs[0].logprobs), expected, atol=1e-4, rtol=0)


def _hf_sparse_block(family: str, experts_implementation: str):
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = tiny_config(family)
    config._experts_implementation = experts_implementation
    blocks = {
        "qwen3_moe": Qwen3MoeSparseMoeBlock,
        "qwen2_moe": Qwen2MoeSparseMoeBlock,
        "mixtral": MixtralSparseMoeBlock,
    }
    return config, blocks[family](config).eval()


@pytest.mark.parametrize("experts_implementation", ["eager", "grouped_mm"])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_sparse_block_matches_hf_within_1e5(family, experts_implementation):
    """One MoE block, float32, against both of transformers' expert paths (per-expert loop, grouped)."""
    config, hf = _hf_sparse_block(family, experts_implementation)
    torch.manual_seed(0)
    for name, param in hf.named_parameters():
        torch.nn.init.normal_(param, std=0.3 if name.endswith("gate.weight") else 0.05)
    ours = moe.SparseMoE(model_class(family).args_from_hf_config(config))
    weights = dict(hf.named_parameters())
    if "shared_expert.gate_proj.weight" in weights:  # ours packs gate/up like the dense MLP
        gate, up = weights.pop("shared_expert.gate_proj.weight"), weights.pop("shared_expert.up_proj.weight")
        weights["shared_expert.gate_up_proj.weight"] = torch.cat([gate, up])
    ours.load_state_dict(weights, strict=True)
    x = torch.randn(1, 37, config.hidden_size)
    with torch.no_grad():
        want = hf(x)
        got = ours(x[0])
    want = (want[0] if isinstance(want, tuple) else want)[0]
    assert want.abs().max() > 0.05  # the experts contribute
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_recorded_routing_is_what_the_hf_routers_pick(family, tiny_model, hf_model):
    """Router replay: prefill and decode record each token's experts, as HF's routers choose them
    over the whole sampled sequence (every token but the last, which no forward read)."""
    from tidal.models.moe_routing import capture_router_logits

    path = tiny_model(family)
    hf = hf_model(path)
    engine = LLMEngine(path, config=cpu_config(record_routing=True))
    params = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=0, ignore_eos=True)
    outputs = engine.generate([PROMPTS[0], PROMPTS[1]], params)
    top_k = hf.config.num_experts_per_tok
    for request in outputs:
        for sample in request.outputs:
            tokens = request.prompt_token_ids + sample.token_ids
            recorded = sample.routed_experts
            assert recorded.shape == (
                len(tokens) - 1,
                engine.model.args.num_layers - _dense_layers(hf),
                top_k,
            )
            with torch.no_grad(), capture_router_logits(hf) as logits:
                hf(input_ids=torch.tensor([tokens[:-1]]))
            expected = torch.stack([x.topk(top_k, dim=-1).indices for x in logits], dim=1)
            # Same experts (their order within the k may differ only between tied probabilities).
            assert torch.equal(torch.from_numpy(recorded).long().sort(-1).values, expected.sort(-1).values)
    plain = LLMEngine(path, config=cpu_config()).generate([PROMPTS[0]], params)
    assert plain[0].outputs[0].routed_experts is None  # recording is opt-in


def _dense_layers(hf) -> int:
    return len(getattr(hf.config, "mlp_only_layers", None) or ())
