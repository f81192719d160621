"""Model code of the rollout engine: shared layers (``layers.py``), one file per family, and the registry
of supported families (``registry.py``); ``loader.py`` builds a family's model from a HF checkpoint."""
