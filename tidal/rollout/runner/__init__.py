"""The device side of the engine: the ``ModelRunner`` that turns a scheduled batch into sampled tokens, its
attention metadata and torch attention (``attention.py``), the ``Sampler``, decode CUDA graphs, image inputs of
vision families, and the tensor-parallel worker processes (``tp_worker.py``)."""
