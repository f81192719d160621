"""Export a (possibly sharded or LoRA-wrapped) model as a plain Hugging Face folder.

The full state dict is gathered to CPU on every rank (FSDP2 needs all ranks to take part) and
rank 0 writes it with ``save_pretrained``; LoRA models save only their adapters, which
``tidal lora_combiner`` merges later.

Nothing is lost on failure: the folder is written to a temporary sibling (``.tmp_<name>``) and its
files replace the target's only once all of them are written, so a full disk or a crash never
leaves ``config.json`` without weights nor damages a previous export (a full disk is reported as
"no space left on <path>"). Weights holding NaN or inf are refused before anything is written. The
export checks the free space first; a final export (``rescue=True``) that has no room, or runs out of it,
writes the model to a rescue folder under the system's temporary folder instead and names it in its
error (``tidal.checkpoint.space``), so the trained weights are never lost to a full disk. A successful
export logs where the model went.
Parameters shared by several modules (tied embeddings) are exported once, as one process does,
also after gathering FSDP2 shards (which returns a separate tensor for each name).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from torch import nn

from tidal.checkpoint.resumable import CheckpointError, agree_ok, first_nonfinite, is_no_space, write_error
from tidal.checkpoint.space import megabytes, rescue_folder, space_problem, tensor_bytes
from tidal.distributed.world import World
from tidal.logging import get_logger

log = get_logger(__name__)

# Weight files of an earlier export that a new one may not overwrite (other shard counts, LoRA vs full).
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")


def retie(model: nn.Module, state_dict: dict) -> dict:
    """Make every name of a shared parameter point at one tensor again (FSDP2's full state dict
    returns a copy per name, and ``save_pretrained`` only drops tied duplicates that share memory)."""
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(param), name)
        if owner != name and owner in state_dict and name in state_dict:
            state_dict[name] = state_dict[owner]
    return state_dict


def _install(tmp: Path, path: Path) -> None:
    """Move the finished export in ``tmp`` into ``path`` (weights first, ``config.json`` last) and drop
    weight files of an earlier export it did not rewrite; other files in ``path`` (the run folder) stay."""
    if not path.exists():
        tmp.rename(path)
        return
    written = {p.name for p in tmp.iterdir()}
    stale = [
        p
        for p in path.iterdir()
        if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES) and p.name not in written
    ]
    for item in sorted(tmp.iterdir(), key=lambda p: p.name == "config.json"):
        target = path / item.name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(item, target)
    for old in stale:
        old.unlink()
    tmp.rmdir()


def _write(model: nn.Module, tokenizer, state_dict: dict, tmp: Path, extra_config: dict | None) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = getattr(model, "config", None)
    if config is not None and extra_config:
        for key, value in extra_config.items():
            setattr(config, key, value)
    model.save_pretrained(str(tmp), state_dict=state_dict, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))


def save_hf_model(
    model: nn.Module,
    tokenizer,
    path: str | Path,
    world: World,
    extra_config: dict | None = None,
    rescue: bool = False,
) -> Path:
    """Write ``model`` (and ``tokenizer``) to ``path`` as a HF folder; returns the path.

    Raises ``CheckpointError`` (one line, on every rank) for non-finite weights or a failed write; with
    ``rescue`` (the final model) a write that has no room goes to a rescue folder, named in the error.
    """
    # here, not at the top: torch.distributed.checkpoint costs ~1 s of start-up, and the modules that
    # import this one (the checkpointer, the critic) export only at the end of a run, if at all
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    path = Path(path)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state_dict = get_model_state_dict(model, options=options)  # the full dict on rank 0 only
    bad = first_nonfinite(state_dict.items()) if world.is_main else None
    if not agree_ok(bad is None, world):
        raise CheckpointError(
            f"refusing to save {path}: the weights contain NaN or inf ({bad or 'see rank 0'})"
        )
    err: BaseException | None = None
    if world.is_main:
        err = _export(model, tokenizer, retie(model, state_dict), path, extra_config, rescue)
    if not agree_ok(err is None, world):
        raise err if isinstance(err, CheckpointError) else write_error(err, path)
    if world.is_main:
        log.info("saved the model to %s", path)
    return path


def _write_folder(
    model: nn.Module, tokenizer, state_dict: dict, path: Path, extra_config
) -> BaseException | None:
    """Write the export to ``path`` through its temporary sibling; the error, or None."""
    tmp = path.parent / f".tmp_{path.name}"
    try:
        _write(model, tokenizer, state_dict, tmp, extra_config)
        _install(tmp, path)
    except Exception as e:  # safetensors reports a full disk as its own error type
        shutil.rmtree(tmp, ignore_errors=True)
        return e
    return None


def _export(
    model, tokenizer, state_dict: dict, path: Path, extra_config, rescue: bool
) -> BaseException | None:
    """Rank 0's export: checked against the free space, rescued when ``rescue`` and there is no room."""
    need = tensor_bytes(state_dict.values())
    short = space_problem(path, need)
    if short is None:
        err = _write_folder(model, tokenizer, state_dict, path, extra_config)
        if err is None or not (rescue and is_no_space(err)):
            return err
        short = f"no space left on {path} (the model needs ~{megabytes(need)})"
    if not rescue:
        return CheckpointError(f"not enough space to save the model: {short}")
    spare = rescue_folder(path)
    if (
        space_problem(spare, need) is None
        and _write_folder(model, tokenizer, state_dict, spare, extra_config) is None
    ):
        return CheckpointError(
            f"{short}: the trained model was saved to {spare} instead; move it where it belongs"
        )
    return CheckpointError(
        f"{short}, and {spare.parent} has no room for it either: the trained model could not be saved "
        "(free space, or keep resumable checkpoints with --save_steps and --ckpt_path on another disk)"
    )
