"""tidal's rollout (generation) engine: continuous batching over a paged KV cache, on CPU or GPU.

    from tidal.rollout import make_engine, EngineConfig, SamplingParams
    engine = make_engine("path/to/hf_model", EngineConfig(max_num_seqs=64))
    outputs = engine.generate([[1, 2, 3]], SamplingParams(n=4, temperature=1.0, max_new_tokens=128))
    outputs[0].outputs[0].token_ids, outputs[0].outputs[0].logprobs

``make_engine`` gives tidal's ``LLMEngine`` for the families of ``models/registry.py`` and the
transformers fallback ``HFEngine`` (``engine/hf_engine.py``: same interface, slower) for any other causal LM.
See ``engine/llm_engine.py`` for the architecture and ``sampling_params.py`` for the log-prob semantics.
"""

from tidal.rollout.engine.config import EngineConfig
from tidal.rollout.engine.hf_engine import HFEngine, make_engine
from tidal.rollout.engine.llm_engine import LLMEngine
from tidal.rollout.outputs import CompletionOutput, RequestOutput
from tidal.rollout.sampling_params import SamplingParams

__all__ = [
    "CompletionOutput",
    "EngineConfig",
    "HFEngine",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "make_engine",
]
