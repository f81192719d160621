"""tidal: post-training for language models (SFT, reward models, preference learning, RL).

The package follows the dataflow of docs/architecture.md: data → rollout → agents/rewards → experience →
algorithms → trainers → distributed/checkpoint, with ``cli`` as thin entry points and ``testing``
building the tiny offline models used by tests, the demo and benchmarks.
"""

__version__ = "0.1.0"
