"""Host-side bookkeeping of the engine: the ``Scheduler`` that picks each step's batch, the ``BlockManager`` of the
paged KV cache (with its ``PrefixCache``), the ``Sequence`` of each sample, and the recurrent-state slots of
linear-attention families (``state_cache.py``)."""
