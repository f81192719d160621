"""The engine layer: ``LLMEngine`` and its ``EngineConfig`` (``llm_engine.py``), and ``make_engine`` with the
transformers fallback ``HFEngine`` for families tidal does not implement (``hf_engine.py``)."""
