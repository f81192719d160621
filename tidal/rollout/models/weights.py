"""How a model of the rollout engine takes HF-named weights: ``WeightLoading``, the loader ``layers.CausalLM``
inherits. HF names (checkpoint files, or ``named_parameters()`` of a trainer's model, with the wrapper
prefixes torch.compile, DDP and FSDP1 add) are renamed as the family declares (``weight_renames``), mapped
onto packed parameters (``packed_params``: q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``) and
copied in place, each tensor into its slice; a (tensor-)parallel layer slices a full tensor to this rank's
shard (``take``). Kept apart from the layers, which are about computing.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

_NAME_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.")


class WeightLoading:
    """Mixed into ``CausalLM``: reads the family's ``packed_params``, ``weight_renames`` and
    ``ignored_weights`` (declared there) and its ``args``."""

    def _packing(self) -> dict[str, tuple[str, int, int, int]]:
        """HF projection -> (packed parameter, shard index, first row, rows)."""
        out = {}
        for packed, shards in self.packed_params.items():
            start = 0
            for index, (hf_name, size_attr) in enumerate(shards):
                rows = getattr(self.args, size_attr)
                out[hf_name] = (packed, index, start, rows)
                start += rows
        return out

    def weight_keys(self) -> set[str]:
        """Every (packed-shard) weight a full checkpoint must provide, in ``load_weights``' key format."""
        shards = {packed: len(parts) for packed, parts in self.packed_params.items()}
        keys = set()
        for name, _ in self.named_parameters():
            count = shards.get(name.rsplit(".", 2)[-2])
            keys.update([name] if count is None else [f"{name}#{i}" for i in range(count)])
        return keys

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our (packed) parameters in place; return the keys loaded."""
        params = dict(self.named_parameters(remove_duplicate=False))
        packing = self._packing()
        loaded = set()
        for raw_name, tensor in named_tensors:
            name = self._our_name(raw_name)
            if name.endswith(self.ignored_weights):
                continue
            module_name, _, kind = name.rpartition(".")
            parent, _, leaf = module_name.rpartition(".")
            shard = packing.get(leaf)
            if shard is not None:
                leaf = shard[0]
            target = f"{parent}.{leaf}.{kind}" if parent else f"{leaf}.{kind}"
            if self.args.tie_word_embeddings and target == "lm_head.weight":
                target = "model.embed_tokens.weight"
            if target not in params:
                raise ValueError(f"unexpected weight {raw_name!r} for a {self.args.model_type} decoder")
            owner = self.get_submodule(target.rpartition(".")[0])
            if hasattr(owner, "take"):  # a (tensor-)parallel layer slices the full tensor to its shard
                part = None if shard is None else shard[1]
                dst, tensor = owner.take(params[target], kind, part, tensor, raw_name)
            else:
                dst = params[target] if shard is None else params[target].narrow(0, shard[2], shard[3])
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"weight {raw_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor)  # one copy, converting device and dtype on the way (no host round trip)
            loaded.add(target if shard is None else f"{target}#{shard[1]}")
        return loaded

    def _our_name(self, name: str) -> str:
        # Wrapper prefixes that torch.compile / DDP / FSDP1 add, then the family's renames.
        for prefix in _NAME_PREFIXES:
            name = name.replace(prefix, "")
        for hf, ours in self.weight_renames:
            name = name.replace(hf, ours)
        return name
