"""tidal's rollout (generation) engine: continuous batching over a paged KV cache, on CPU or GPU.

    from tidal.rollout import make_engine, EngineConfig, SamplingParams
    engine = make_engine("path/to/hf_model", EngineConfig(max_num_seqs=64))
    outputs = engine.generate([[1, 2, 3]], SamplingParams(n=4, temperature=1.0, max_new_tokens=128))
    outputs[0].outputs[0].token_ids, outputs[0].outputs[0].logprobs

``make_engine`` gives tidal's ``LLMEngine`` for the families of ``models/registry.py`` and the
transformers fallback ``HFEngine`` (``engine/hf_engine.py``: same interface, slower) for any other causal LM.
See ``engine/llm_engine.py`` for the architecture and ``sampling_params.py`` for the log-prob semantics.

The folders by role: ``engine/`` (``LLMEngine``, ``EngineConfig``, ``make_engine``, the fallback),
``scheduling/`` (scheduler, KV block manager, prefix cache, sequences, recurrent-state slots), ``runner/``
(model runner, attention metadata, sampler, CUDA graphs, tensor-parallel workers), ``kernels/`` (Triton),
``models/`` (one file per family and the family registry), ``batch_invariant/`` (exact mode's ops).

The names below are imported on first use (``tidal.lazy``), so that reading the family registry
(``tidal.rollout.models.registry``, plain data) does not import torch and the engine.
"""

from typing import TYPE_CHECKING

from tidal.lazy import lazy_exports

if TYPE_CHECKING:  # the same names for type checkers, and for tests/test_imports.py's import graph
    from tidal.rollout.engine.config import EngineConfig
    from tidal.rollout.engine.hf_engine import HFEngine, make_engine
    from tidal.rollout.engine.llm_engine import LLMEngine
    from tidal.rollout.outputs import CompletionOutput, RequestOutput
    from tidal.rollout.sampling_params import SamplingParams

# name → the submodule that defines it, imported when the name is first used (see tidal.lazy)
_EXPORTS = {
    "CompletionOutput": "tidal.rollout.outputs",
    "EngineConfig": "tidal.rollout.engine.config",
    "HFEngine": "tidal.rollout.engine.hf_engine",
    "LLMEngine": "tidal.rollout.engine.llm_engine",
    "RequestOutput": "tidal.rollout.outputs",
    "SamplingParams": "tidal.rollout.sampling_params",
    "make_engine": "tidal.rollout.engine.hf_engine",
}

__all__ = [
    "CompletionOutput",
    "EngineConfig",
    "HFEngine",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "make_engine",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
