"""Resumable training checkpoints: sharded model and optimizer state (DCP) plus loop state.

Layout of ``--ckpt_path``::

    global_step_20/            one checkpoint, written to a temporary folder then renamed
      model_optim/             torch.distributed.checkpoint of every trained part's model and
                               optimizer (each rank writes its shards)
      trainer_state_rank0.pt   scheduler, step counters, RNG states (one file per rank)
      meta.json                trainer kind, model fingerprint, settings, lineage (written last)
    latest                     name of the newest complete checkpoint

Only complete checkpoints are ever named by ``latest``, so a crash (even ``kill -9``) while saving
loses nothing already saved. ``latest_checkpoint`` checks the folder it names and falls back, with a
warning, to the newest intact checkpoint when ``latest`` is missing, empty, dangling or names a
damaged folder. Rotation (``--max_ckpt_num``) removes the oldest checkpoints *of the same lineage*
(one run and its resumptions) and never the one just written, so checkpoints an older run left in
the same folder are neither counted nor deleted.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from tidal.distributed.world import World, all_reduce_sum
from tidal.logging import get_logger

log = get_logger(__name__)

PREFIX = "global_step_"
META = "meta.json"

# torch.distributed.checkpoint (~1 s of start-up) is imported by the functions that save, load or check
# shards: every command imports this module for ``CheckpointError`` (``tidal.cli.common``), and most
# processes (engines, ``tidal serve``, a run that never saves) never touch a shard.


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or resumed; the message is one line naming the folder."""


@dataclass
class LoopState:
    """Where the training loop is: enough to continue exactly where it stopped."""

    global_step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


_NO_SPACE_TEXTS = ("No space left on device", "StorageFull", "os error 28")


# ---- space and failures ---------------------------------------------------------------------------
def _causes(err: BaseException | None):
    """``err``, what caused it, and the per-rank failures inside a DCP ``CheckpointException``."""
    seen: set[int] = set()
    stack = [err]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            stack.extend(f[0] if isinstance(f, tuple) else f for f in failures.values())
        stack.extend([e.__cause__, e.__context__])


def is_no_space(err: BaseException | None) -> bool:
    """Whether ``err`` comes from a full disk (ENOSPC, or safetensors' text for it)."""
    return any(
        (isinstance(e, OSError) and e.errno == errno.ENOSPC) or any(t in str(e) for t in _NO_SPACE_TEXTS)
        for e in _causes(err)
    )


def is_io_error(err: BaseException | None) -> bool:
    """Whether ``err`` is (or wraps) a filesystem error rather than a bug."""
    return is_no_space(err) or any(isinstance(e, OSError) for e in _causes(err))


def write_error(err: BaseException | None, path: Path) -> BaseException:
    """A one-line error for a failed write to ``path`` (a full disk says so plainly); ``err`` itself
    when it is not a filesystem error (a bug keeps its traceback)."""
    if err is None:
        return CheckpointError(f"could not write {path} (another process failed)")
    if is_no_space(err):
        return CheckpointError(f"no space left on {path}")
    if not is_io_error(err):
        return err
    cause = next(e for e in _causes(err) if isinstance(e, OSError))
    return CheckpointError(f"could not write {path}: {cause}")


def agree_ok(ok: bool, world: World) -> bool:
    """True when every rank is ok (one collective), so all ranks raise or continue together."""
    return all_reduce_sum(0 if ok else 1, world) == 0


# ---- non-finite weights ---------------------------------------------------------------------------
def first_nonfinite(named_tensors) -> str | None:
    """The name of the first floating tensor holding NaN/inf (this rank's shards), or None."""
    for name, t in named_tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        if torch.is_floating_point(local) and local.numel() and not bool(torch.isfinite(local).all()):
            return name
    return None


def ensure_finite(models: dict, world: World, target: Path) -> None:
    """Refuse (one line, on every rank) to save ``models`` when any weight is NaN or inf."""
    bad = None
    for name, model in models.items():
        param = first_nonfinite(model.named_parameters())
        if param is not None:
            bad = f"{name}: {param}"
            break
    if not agree_ok(bad is None, world):
        where = f" ({bad})" if bad else " (on another process)"
        raise CheckpointError(f"refusing to save {target}: the weights contain NaN or inf{where}")


# ---- finding checkpoints --------------------------------------------------------------------------
def _step_of(folder: Path) -> int | None:
    tail = folder.name[len(PREFIX) :]
    return int(tail) if folder.name.startswith(PREFIX) and tail.isdigit() else None


def checkpoint_folders(ckpt_path: Path) -> list[Path]:
    """Every ``global_step_N`` folder (complete or not), by step number."""
    if not ckpt_path.is_dir():
        return []
    found = [p for p in ckpt_path.iterdir() if p.is_dir() and _step_of(p) is not None]
    return sorted(found, key=_step_of)


def read_meta(folder: Path) -> dict:
    """The checkpoint's ``meta.json`` ({} when absent or unreadable)."""
    try:
        return json.loads((folder / META).read_text())
    except (OSError, ValueError):
        return {}


def damage(folder: Path) -> str | None:
    """Why ``folder`` is not an intact checkpoint (missing or truncated files), or None if it is."""
    if not folder.is_dir():
        return "no such folder"
    meta = read_meta(folder)
    if not meta:
        return f"{META} missing or unreadable"
    import torch.distributed.checkpoint as dcp  # start-up cost: see the top

    dcp_dir = folder / "model_optim"
    try:
        metadata = dcp.FileSystemReader(str(dcp_dir)).read_metadata()
    except Exception as err:  # a missing or truncated .metadata raises whatever unpickling hits
        return f"model_optim/.metadata unreadable ({type(err).__name__})"
    for info in (metadata.storage_data or {}).values():
        data = dcp_dir / info.relative_path
        if not data.is_file() or data.stat().st_size < info.offset + info.length:
            return f"model_optim/{info.relative_path} missing or truncated"
    for rank in range(int(meta.get("world_size", 1))):
        state = folder / f"trainer_state_rank{rank}.pt"
        try:
            with zipfile.ZipFile(state) as archive:  # torch.save writes a zip; truncation breaks it
                if archive.testzip() is not None:
                    raise zipfile.BadZipFile
        except (OSError, zipfile.BadZipFile):
            return f"{state.name} missing or truncated"
    return None


def _written_order(folder: Path) -> tuple[int, int]:
    return int(read_meta(folder).get("written_ns", 0)), _step_of(folder) or 0


def latest_checkpoint(ckpt_path: str | Path) -> Path | None:
    """The checkpoint to resume from: the one ``latest`` names when it is intact, else the newest
    intact one (with a warning); None when ``ckpt_path`` holds no checkpoint at all.

    Raises ``CheckpointError`` when checkpoints exist but none is intact, rather than starting over.
    """
    ckpt_path = Path(ckpt_path)
    pointer = ckpt_path / "latest"
    named = pointer.read_text().strip() if pointer.is_file() else ""
    if named:
        why = damage(ckpt_path / named)
        if why is None:
            return ckpt_path / named
        problem = f"{pointer} names {named}, which is not usable ({why})"
    else:
        problem = f"{pointer} is empty" if pointer.is_file() else f"{pointer} is missing"
    folders = checkpoint_folders(ckpt_path)
    if not folders:
        if named or pointer.is_file():
            log.warning("%s and there is no checkpoint: starting from scratch", problem)
        return None
    intact = [f for f in folders if damage(f) is None]
    if not intact:
        raise CheckpointError(
            f"no intact checkpoint in {ckpt_path} ({problem}; "
            + ", ".join(f"{f.name}: {damage(f)}" for f in folders)
            + "): remove them or drop --load_checkpoint"
        )
    chosen = max(intact, key=_written_order)
    log.warning("%s: resuming from %s, the newest intact checkpoint", problem, chosen.name)
    return chosen


# ---- rotation -------------------------------------------------------------------------------------
def rotate(ckpt_path: Path, keep: int, written: Path) -> list[Path]:
    """Remove the oldest checkpoints of ``written``'s lineage beyond ``keep``; never ``written`` itself
    nor another run's checkpoints. Returns the removed folders."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    lineage = read_meta(written).get("lineage")
    own = [
        f for f in checkpoint_folders(ckpt_path) if f != written and read_meta(f).get("lineage") == lineage
    ]
    own.sort(key=_written_order)
    removed = own[: max(len(own) - (keep - 1), 0)]
    for old in removed:
        shutil.rmtree(old, ignore_errors=True)
    return removed


def remove_temporaries(ckpt_path: str | Path) -> None:
    """Delete ``.tmp_*`` folders a killed save left behind (main process, between saves): a rolling
    checkpoint's (``.tmp_global_step_N``) or a named one's (``.tmp_best_global_step_N``)."""
    for tmp in Path(ckpt_path).glob(f".tmp_*{PREFIX}*"):
        shutil.rmtree(tmp, ignore_errors=True)


# ---- save / load ----------------------------------------------------------------------------------
def _dcp_state(parts: dict) -> dict:
    """``{"<name>_model": ..., "<name>_optim": ...}`` for every part (an object with model/optimizer)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict  # start-up cost: see the top

    state = {}
    for name, part in parts.items():
        state[f"{name}_model"], state[f"{name}_optim"] = get_state_dict(part.model, part.optimizer)
    return state


def _write_shards(parts: dict, loop: LoopState, world: World, tmp: Path, extra) -> BaseException | None:
    """This rank's DCP shards and trainer state into ``tmp``; the error instead of raising it."""
    import torch.distributed.checkpoint as dcp  # start-up cost: see the top
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.save(_dcp_state(parts), checkpoint_id=str(tmp / "model_optim"))
        state = {
            "loop": asdict(loop),
            "schedulers": {k: p.scheduler.state_dict() for k, p in parts.items()},
            "rng": rng_state(),
            "extra": extra or {},
        }
        torch.save(state, tmp / f"trainer_state_rank{world.rank}.pt")
    except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
        return err
    return None


def save_checkpoint(
    ckpt_path,
    parts: dict,
    loop: LoopState,
    world: World,
    keep: int = 3,
    extra=None,
    meta: dict | None = None,
    name: str | None = None,
) -> Path:
    """Save every part (``model``, ``optimizer``, ``scheduler``), the loop state and RNG; returns the folder.

    ``parts`` maps a name (``model``, ``policy``, ``critic``) to an object with those three attributes;
    ``meta`` (trainer kind, fingerprints, ``lineage``) goes to ``meta.json``. Weights with NaN/inf are
    refused; a failed write (e.g. a full disk) removes the temporary folder and raises one line.
    ``name``: a checkpoint kept beside the rolling ones (the best by an eval metric, ``best_global_step_N``):
    same contents, but ``latest`` does not name it and rotation neither counts nor removes it.
    """
    ckpt_path = Path(ckpt_path)
    rolling = name is None
    name = name or f"{PREFIX}{loop.global_step}"
    tmp, final = ckpt_path / f".tmp_{name}", ckpt_path / name
    ensure_finite({k: p.model for k, p in parts.items()}, world, final)
    err: BaseException | None = None
    if world.is_main:
        try:
            remove_temporaries(ckpt_path)
            tmp.mkdir(parents=True)
        except OSError as e:
            err = e
    if agree_ok(err is None, world):
        err = _write_shards(parts, loop, world, tmp, extra)
        if agree_ok(err is None, world) and world.is_main:
            try:
                info = {**(meta or {}), "global_step": loop.global_step, "world_size": world.world_size}
                (tmp / META).write_text(json.dumps({**info, "written_ns": time.time_ns()}, indent=1))
                shutil.rmtree(final, ignore_errors=True)
                tmp.rename(final)
                if rolling:
                    _write_pointer(ckpt_path, name)
                    rotate(ckpt_path, keep, final)
            except OSError as e:
                err = e
    if not agree_ok(err is None, world):  # also the barrier: every rank returns after the rename
        if world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise write_error(err, ckpt_path)
    return final


def _write_pointer(ckpt_path: Path, name: str) -> None:
    """Replace ``latest`` atomically (a crash never leaves it empty)."""
    tmp = ckpt_path / ".latest.tmp"
    tmp.write_text(name)
    os.replace(tmp, ckpt_path / "latest")


def trainer_state_file(folder: Path, rank: int) -> Path:
    """This rank's trainer state; rank 0's when the checkpoint was written by fewer processes (a run
    resumed on more processes or another tensor-parallel layout: the loop and schedulers are the same on
    every rank, and the model and optimizer shards are resharded by DCP)."""
    own = folder / f"trainer_state_rank{rank}.pt"
    return own if rank < int(read_meta(folder).get("world_size", 1)) else folder / "trainer_state_rank0.pt"


def load_checkpoint(folder, parts: dict, world: World) -> tuple[LoopState, dict]:
    """Restore every part, the schedulers and RNG from ``folder``; returns the loop state and extras."""
    import torch.distributed.checkpoint as dcp  # start-up cost: see the top
    from torch.distributed.checkpoint.state_dict import set_state_dict

    folder = Path(folder)
    state = _dcp_state(parts)
    dcp.load(state, checkpoint_id=str(folder / "model_optim"))
    for name, part in parts.items():
        set_state_dict(
            part.model,
            part.optimizer,
            model_state_dict=state[f"{name}_model"],
            optim_state_dict=state[f"{name}_optim"],
        )
    trainer_state = torch.load(trainer_state_file(folder, world.rank), weights_only=False)
    for name, part in parts.items():
        part.scheduler.load_state_dict(trainer_state["schedulers"][name])
    set_rng_state(trainer_state["rng"])
    return LoopState(**trainer_state["loop"]), trainer_state.get("extra", {})
