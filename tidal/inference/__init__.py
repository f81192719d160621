"""Batch inference and interactive chat on tidal's rollout engine.

- ``generate``: ``tidal generate`` — sample K responses per prompt, score them with a reward model,
  post-process (``processors``: rejection sampling, conditional SFT, iterative DPO) and write JSONL.
- ``chat``: ``tidal chat`` — a multi-turn terminal conversation that keeps its history.
"""

from tidal.inference.processors import POST_PROCESSORS, PromptGroup, make_post_processor

__all__ = ["POST_PROCESSORS", "PromptGroup", "make_post_processor"]
