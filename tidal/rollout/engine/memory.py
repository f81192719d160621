"""``LLMEngine``'s weights and memory: ``update_weights`` loads a trainer's tensors in place, ``sleep`` frees
the KV cache (and at level 2 moves the weights to the CPU) so a trainer can share the device, ``wake_up``
restores them."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import torch

from tidal.logging.console import get_logger
from tidal.logging.phases import on_main_process, phase, size_text
from tidal.rollout.runner import kv_cache

log = get_logger(__name__)


class WeightsAndMemory:
    """A mixin of ``LLMEngine`` (it reads the engine's model, runner, block manager, peers and config)."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping) -> int:
        """Load HF-named tensors in place (e.g. ``policy.named_parameters()``); return how many were loaded.

        Tied embeddings are handled (``lm_head.weight`` and ``model.embed_tokens.weight`` are one tensor);
        sharded DTensors are gathered with ``full_tensor()``.
        """
        if isinstance(named_tensors, Mapping):
            named_tensors = named_tensors.items()
        self._drop_ahead()  # it ran with the old weights
        self.block_manager.invalidate_prefix_cache()  # cached K/V was computed with the old weights
        count, nbytes, start = 0, 0, time.perf_counter()

        def gathered():
            nonlocal count, nbytes
            for name, tensor in named_tensors:
                count += 1
                nbytes += tensor.numel() * tensor.element_size()
                yield name, tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach()

        self.model.load_weights(gathered() if self.peers is None else self.peers.loading(gathered()))
        if on_main_process():
            log.info("engine: weights updated, %d tensors (%s as given) in %.1f s", count, size_text(nbytes),
                     time.perf_counter() - start)  # fmt: skip
        return count

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1); level 2 also moves the weights to CPU."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self._drop_ahead()
        self.block_manager.invalidate_prefix_cache()  # the cache's contents are freed
        with phase(f"engine: sleeping (level {level}: frees the {self._sleep_text(level)})"):
            if self.peers is not None:
                self.peers.sleep(level)
            self.runner.free_kv_cache()
            if level == 2 and self.device.type != "cpu":
                self.model.to("cpu")  # weights and the tables derived from them (RoPE buffers)
                torch.cuda.empty_cache()
        self.sleep_level = level

    def wake_up(self) -> None:
        """Restore what ``sleep`` freed; the KV cache comes back empty (no request survives a sleep)."""
        with phase(f"engine: waking up ({self._sleep_text(self.sleep_level)})"):
            if self.peers is not None:
                self.peers.wake()
            if self.sleep_level == 2 and self.device.type != "cpu":
                self.model.to(self.device)
            if self.runner.kv_cache is None:
                self.runner.allocate_kv_cache()
        self.sleep_level = 0

    def _sleep_text(self, level: int) -> str:
        """What a sleep of ``level`` frees: ``"KV cache, 4.4 GiB"`` (level 2 adds ``"; weights, 14.2 GiB"``)."""
        text = f"KV cache, {size_text((self.num_kv_blocks + 1) * self.kv_bytes_per_block())}"
        if level == 2:
            weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
            text += f"; weights, {size_text(weights)}"
        return text

    def kv_bytes_per_block(self) -> int:
        """Bytes of one KV block on this rank, in the cache's dtype (``kv_cache.bytes_per_block``)."""
        fp8 = self.config.kv_cache_dtype == "fp8"
        return kv_cache.bytes_per_block(self.model.args, self.config.block_size, self.dtype, fp8)

    def _log_kv_cache(self) -> None:
        tokens = self.num_kv_blocks * self.config.block_size
        kv = size_text(self.num_kv_blocks * self.kv_bytes_per_block())
        if on_main_process():
            fp8 = " (FP8 e4m3, a scale per row)" if self.config.kv_cache_dtype == "fp8" else ""
            log.info("engine: KV cache of %d blocks, %d tokens, %s%s", self.num_kv_blocks, tokens, kv, fp8)

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_level > 0
