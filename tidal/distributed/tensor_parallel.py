"""Tensor parallelism for training (``--ds_tensor_parallel_size N``): DTensor TP inside FSDP2.

The processes form a 2-D device mesh ``(dp, tp)`` with ``tp`` innermost, so the ``N`` ranks of one
tensor-parallel group are consecutive (one node's GPUs with NVLink between them). Each decoder layer's
linear layers are split over ``tp`` with ``torch.distributed.tensor.parallel``: q/k/v and gate/up are
column-parallel (each rank holds ``heads / N`` attention heads and ``intermediate / N`` MLP columns),
o and down are row-parallel (their partial outputs are all-reduced), as the model family's
``base_model_tp_plan`` (transformers' config class) says, or ``DEFAULT_PLAN`` when it has none. HF's
attention modules reshape with ``-1`` heads, so they run on the local heads as they are. Embeddings,
norms and the LM head stay whole on every tp rank (tidal's chunked log-prob head reads
``lm_head.weight`` directly); FSDP2 then shards everything over the ``dp`` sub-mesh.

Every tp rank of one data-parallel group sees the same batch and computes the same (replicated) loss:
the trainers shard data by ``World.dp_rank`` / ``World.dp_size``. Means over all ranks then equal means
over ``dp`` (each dp value appears ``N`` times), and totals multiply by ``dp_size``.

``layout_problems`` names every impossible layout (tp not dividing the world size, the heads or the
MLP width; LoRA or MoE models together with tp) before any model loads (ring attention with tp is
refused by ``DistributedConfig``).
"""

from __future__ import annotations

import dataclasses
import fnmatch

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from tidal.config.args import ConfigError
from tidal.distributed.world import World

# The plan of the families whose transformers config class has no ``base_model_tp_plan`` (Llama-style
# attention and gated MLP): the same names and styles as transformers' own plans.
DEFAULT_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}

# Model types whose experts would need expert-parallel styles (transformers' "moe_tp_experts"): refused.
MOE_HINTS = ("num_experts", "num_local_experts")


class HeadShardedNorm(ParallelStyle):
    """A per-head norm (Qwen3's ``q_norm``/``k_norm``) applied to this rank's heads: its weight is
    replicated over tp and its input is sharded along the heads dimension (``-2``), so the weight's
    gradient, a sum over every head, is all-reduced over tp (transformers' style
    "replicated_with_grad_allreduce")."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name, mod, mesh):
            for key, param in list(mod.named_parameters(recurse=False)):
                dist_param = nn.Parameter(
                    DTensor.from_local(param.data, mesh, [Replicate()], run_check=False)
                )
                mod.register_parameter(key, dist_param)

        def to_dtensor(mod, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, [Shard(x.dim() - 2)], run_check=False) for x in inputs)

        def to_local(mod, output, mesh):
            return output.to_local()

        return distribute_module(module, device_mesh, partition, to_dtensor, to_local)


def make_style(name: str) -> ParallelStyle | None:
    """The torch parallel style of a transformers TP-plan entry (None: one tidal cannot apply)."""
    styles = {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        # The output is gathered whole (a norm over all heads follows, e.g. OLMo2, or a chunk, e.g. Phi-3).
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        # The input is whole on every rank; each takes its slice.
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "replicated_with_grad_allreduce": lambda: HeadShardedNorm(),
    }
    make = styles.get(name)
    return make() if make else None


def tp_plan(config) -> dict[str, str]:
    """The family's TP plan: transformers' ``base_model_tp_plan`` where the config has one."""
    return dict(getattr(config, "base_model_tp_plan", None) or DEFAULT_PLAN)


def _is_moe(config) -> bool:
    return any(int(getattr(config, hint, 0) or 0) > 0 for hint in MOE_HINTS)


def _divides(tp: int, what: str, value) -> list[str]:
    if value is None or int(value) % tp == 0:
        return []
    return [f"--ds_tensor_parallel_size {tp} must divide {what} = {value}"]


def layout_problems(
    tp: int, world_size: int, config=None, lora_rank: int = 0, model: str = "the model"
) -> list[str]:
    """Every reason ``tp``-way tensor parallelism cannot train ``config`` on ``world_size`` processes,
    one line each naming the flags and numbers (empty when it can, or when ``tp`` is 1)."""
    if tp <= 1:
        return []
    found = []
    if world_size % tp:
        found.append(f"--ds_tensor_parallel_size {tp} must divide the number of processes ({world_size})")
    if lora_rank > 0:
        found.append(
            f"--ds_tensor_parallel_size {tp} with --lora_rank {lora_rank}: LoRA is not tensor-parallel"
        )
    if config is None:
        return found
    if _is_moe(config):
        found.append(
            f"--ds_tensor_parallel_size {tp}: {model} is a mixture-of-experts model "
            f"({config.model_type}); tensor-parallel experts are not supported"
        )
        return found
    unknown = sorted({style for style in tp_plan(config).values() if make_style(style) is None})
    if unknown:
        found.append(
            f"--ds_tensor_parallel_size {tp}: {model} ({config.model_type}) needs tensor-parallel styles "
            f"tidal does not apply ({', '.join(unknown)})"
        )
    found += _divides(tp, f"num_attention_heads of {model}", getattr(config, "num_attention_heads", None))
    found += _divides(tp, f"num_key_value_heads of {model}", getattr(config, "num_key_value_heads", None))
    found += _divides(tp, f"intermediate_size of {model}", getattr(config, "intermediate_size", None))
    return found


def model_layout_problems(tp: int, world_size: int, models: dict[str, object]) -> list[str]:
    """``layout_problems`` of each trained model, ``{flag: ModelConfig}`` (e.g. ``{"--pretrain": ...}``),
    read from its ``config.json`` only (nothing loads). A folder whose config cannot be read is left to
    the model loader, which names it."""
    if tp <= 1:
        return []
    from transformers import AutoConfig

    found = layout_problems(tp, world_size)
    for flag, cfg in models.items():
        try:
            config = AutoConfig.from_pretrained(cfg.pretrain)
        except (OSError, ValueError, KeyError):
            config = None
        model = f"{flag} {cfg.pretrain}"
        found += [p for p in layout_problems(tp, world_size, config, cfg.lora_rank, model) if p not in found]
    return found


def with_tensor_parallel(world: World, tp: int) -> World:
    """``world`` whose ranks form data-parallel groups of ``tp`` tensor-parallel ranks."""
    return world if world.tp_size == tp else dataclasses.replace(world, tp_size=tp)


def training_mesh(world: World, zero_stage: int) -> tuple[DeviceMesh, DeviceMesh | None]:
    """``(FSDP2 mesh, tp mesh or None)`` of ``world``: with tp, FSDP2 shards over the dp sub-mesh of
    a ``(dp, tp)`` mesh (stage 0 replicates: ``(replicate, shard, tp)`` with shard size 1)."""
    kind = world.device.type
    if world.tp_size <= 1:
        if zero_stage == 0:
            return init_device_mesh(kind, (world.world_size, 1), mesh_dim_names=("replicate", "shard")), None
        return init_device_mesh(kind, (world.world_size,)), None
    if zero_stage == 0:
        mesh = init_device_mesh(
            kind, (world.dp_size, 1, world.tp_size), mesh_dim_names=("replicate", "shard", "tp")
        )
        return mesh["replicate", "shard"], mesh["tp"]
    mesh = init_device_mesh(kind, (world.dp_size, world.tp_size), mesh_dim_names=("dp", "tp"))
    return mesh["dp"], mesh["tp"]


def matching_modules(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    """Submodules whose qualified name is ``pattern`` (transformers' base-model-relative, ``*`` for the
    layer index) under any prefix (``model.``, a value model's body...)."""
    return [
        (name, mod)
        for name, mod in model.named_modules()
        if name and (fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, f"*.{pattern}"))
    ]


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Split ``model``'s decoder layers over ``tp_mesh`` in place, following its family's plan.

    The trained models' layouts were checked before loading; a frozen model (a reference or teacher from
    another folder) is checked here, since DTensor would split a head across ranks without complaint."""
    problems = layout_problems(tp_mesh.size(), tp_mesh.size(), model.config, model=model.config.name_or_path)
    if problems:
        raise ConfigError("; ".join(problems))
    plan = tp_plan(model.config)
    split = 0
    for pattern, style_name in plan.items():
        for _, module in matching_modules(model, pattern):
            style = make_style(style_name)
            if style is None:  # layout_problems refused it before the model loaded
                raise ValueError(f"tensor-parallel style {style_name!r} of {pattern} is not supported")
            parallelize_module(module, tp_mesh, style)
            split += 1
    if not split:  # a plan naming none of the modules would leave every tp rank a whole replica
        raise ValueError(f"the tensor-parallel plan of {type(model).__name__} matches none of its modules")
    return model


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over gradients that may live on several meshes.

    With tensor parallelism the decoder layers' gradients are DTensors on the ``(dp, tp)`` mesh and
    the rest (embeddings, norms, head) on the ``dp`` mesh, which torch's clip cannot stack together:
    here each mesh's norm is taken apart, made whole, and combined. One mesh: torch's clip as is."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
        groups.setdefault(key, []).append(p.grad)
    if len(groups) <= 1:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    parts = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads)
        parts.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float().cpu())
    total = torch.linalg.vector_norm(torch.stack(parts))
    coef = min(max_norm / (float(total) + 1e-6), 1.0)  # as torch's clip: never scales up
    for grads in groups.values():
        torch._foreach_mul_(grads, coef)
    return total
