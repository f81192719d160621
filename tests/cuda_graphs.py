"""Test helper: capture a function's CUDA work in a graph, as the engine does, for replay tests."""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture(step: Callable):
    """Run ``step`` once (its kernels compile outside the capture), then capture a call on a side stream.
    Returns (the graph, that call's outputs: static tensors each ``graph.replay()`` rewrites)."""
    step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = step()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, outputs
