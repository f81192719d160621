"""Qwen3.5's decode in the shape the CUDA graphs run it, on the CPU: the engine stages each decode step into
``DecodeGraphs``' static buffers (batch padded up to a bucket, each row's read and write state slots in a
static buffer, padding rows at the state cache's scratch slot) and runs the forward on those buffers, as a
replay would. Only the capture itself needs CUDA: here a "graph" runs the forward eagerly on the static
buffers. Tokens equal the eager engine's (log-probs to float noise: a padded bucket is another matmul
shape), async scheduling's tokens and log-probs equal the synchronous loop's bit for bit, and no step (nor the warm-up and capture runs) writes any state slot but its live rows' and the scratch one.
The same on CUDA with real graphs: test_qwen3_5_gpu.py."""

from __future__ import annotations

import pytest
import torch

from tests.rollout.reference import PROMPTS, cpu_config
from tidal.rollout import LLMEngine, SamplingParams
from tidal.rollout.runner.cuda_graph import DecodeGraphs

FAMILIES = ["qwen3_5_text", "qwen3_5_moe_text"]


def _changed_slots(before: tuple[torch.Tensor, torch.Tensor], states) -> set[int]:
    """The state slots whose conv or recurrent state differs from ``before`` in any layer."""
    conv = (states.conv != before[0]).flatten(2).any(-1).any(0)
    rec = (states.recurrent != before[1]).flatten(2).any(-1).any(0)
    return set((conv | rec).nonzero().flatten().tolist())


class EagerReplay:
    """A captured bucket stand-in: ``replay`` runs the forward on the static buffers into static logits,
    checking that padding rows point at the scratch slot and that only live rows' write slots change."""

    def __init__(self, graphs: DecodeGraphs, rows: int, states, buckets: list[tuple[int, int]]):
        self.graphs, self.rows, self.states, self.buckets = graphs, rows, states, buckets
        self.inputs = graphs.inputs(rows)
        # As ``DecodeGraphs._capture``: zero contexts, the scratch slot everywhere, then warm-up + capture.
        graphs.input_ids.zero_()
        graphs.context_lens.zero_()
        graphs.state_slots.fill_(graphs.pad_state_slot)
        before = (states.conv.clone(), states.recurrent.clone())
        graphs.forward(*self.inputs)
        self.logits = graphs.forward(*self.inputs)
        assert _changed_slots(before, states) <= {states.pad_slot}

    def replay(self) -> None:
        pad = self.states.pad_slot
        live = self.graphs.context_lens[: self.rows] > 0
        slots = self.graphs.state_slots[:, : self.rows]
        assert (slots[:, ~live] == pad).all()  # padding rows read and write the scratch slot
        before = (self.states.conv.clone(), self.states.recurrent.clone())
        self.logits.copy_(self.graphs.forward(*self.inputs))
        assert _changed_slots(before, self.states) <= set(slots[1, live].tolist()) | {pad}
        self.buckets.append((self.rows, int(live.sum())))


def graph_shaped(engine: LLMEngine, monkeypatch) -> list[tuple[int, int]]:
    """Give ``engine`` (on the CPU) decode graphs whose replays run eagerly; returns the (bucket rows, live
    rows) of every replay."""
    runner, buckets = engine.runner, []
    max_blocks = -(-engine.max_model_len // engine.config.block_size)
    graphs = DecodeGraphs(
        runner.decode_forward, runner.device, engine.config.max_num_seqs, max_blocks, runner.states.pad_slot
    )

    def capture(rows: int):
        replay = EagerReplay(graphs, rows, runner.states, buckets)
        graphs.graphs[rows] = (replay, replay.logits)
        return graphs.graphs[rows]

    monkeypatch.setattr(graphs, "_capture", capture)
    runner.graphs = graphs
    return buckets


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


def _outputs(outs) -> list:
    return [[(s.token_ids, s.logprobs, s.finish_reason) for s in o.outputs] for o in outs]


@pytest.mark.parametrize("family", FAMILIES)
def test_graph_shaped_decode_equals_eager_decode(family, tiny_model, monkeypatch):
    path = tiny_model(family, logit_scale=4.0)
    config = dict(max_model_len=96, block_size=4, max_num_seqs=8)
    eager = LLMEngine(path, cpu_config(**config))
    # Requests ending at different steps (the batch shrinks through buckets 8, 4, 2, 1 with padding rows),
    # n samples sharing a prefill, sampled and greedy rows.
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3]]
    params = [
        SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True),
        # (stop ids: a sample stops early, so a step launched ahead is discarded while the others go on)
        SamplingParams(temperature=1.0, max_new_tokens=7, seed=1, n=3, stop_token_ids=range(300, 420)),
        SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=10, seed=2, ignore_eos=True),
        SamplingParams(temperature=1.0, max_new_tokens=4, seed=3, n=2, ignore_eos=True, logprobs=2),
    ]
    want = _outputs(eager.generate(prompts, params))
    graph_outputs = []
    for async_scheduling in (False, True):
        engine = LLMEngine(path, cpu_config(async_scheduling=async_scheduling, **config))
        engine.ahead_policy.max_miss_rate = 1.0
        buckets = graph_shaped(engine, monkeypatch)
        got = _outputs(engine.generate(prompts, params))
        graph_outputs.append(got)
        # The eager engine's tokens; log-probs to float noise (a padded bucket is another matmul shape,
        # which the CPU's float32 matmuls do not keep row for row). Bit for bit: synchronous vs async below.
        assert [[s[0] for s in o] for o in got] == [[s[0] for s in o] for o in want]
        for got_out, want_out in zip(got, want, strict=True):
            for got_sample, want_sample in zip(got_out, want_out, strict=True):
                torch.testing.assert_close(
                    torch.tensor(got_sample[1]), torch.tensor(want_sample[1]), atol=1e-5, rtol=0
                )
        assert any(rows > live for rows, live in buckets), "some bucket should have padding rows"
        assert {rows for rows, _ in buckets} == {8, 4, 2, 1}  # 7 samples, then fewer as they end
        if async_scheduling:
            assert 0 < engine.ahead_stats.used < engine.ahead_stats.launched
        # Continuous batching: a request joins while another decodes, each finishing at its own step:
        # the eager engine's tokens for each alone (log-probs to float noise: other batch shapes).
        first = engine.add_request(PROMPTS[1], greedy(12))
        for _ in range(4):
            engine.step()
        second = engine.add_request(PROMPTS[2], greedy(5))
        done = {}
        while engine.has_unfinished():
            done.update({out.request_id: out.outputs[0] for out in engine.step() if out.finished})
        for request, prompt, n in ((first, PROMPTS[1], 12), (second, PROMPTS[2], 5)):
            alone = eager.generate([prompt], greedy(n))[0].outputs[0]
            assert done[request].token_ids == alone.token_ids
            torch.testing.assert_close(
                torch.tensor(done[request].logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0
            )
    assert graph_outputs[0] == graph_outputs[1]  # async scheduling: bit for bit the synchronous loop's
