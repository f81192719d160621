"""The processes of a tensor-parallel rollout engine (``EngineConfig.tp_size`` N > 1).

The process that builds ``LLMEngine`` is rank 0: it owns the scheduler, the sequences, the sampler and
the engine's API. It starts ranks 1..N-1 itself, one per device (all on the CPU, or N GPUs), as fresh
Python processes (``python -m tidal.rollout.runner.tp_worker``; not ``multiprocessing``, whose daemonic
processes — an engine process of ``tidal ppo``'s separate engines — may not have children), hands them
their ``WorkerSpec`` through the rendezvous store, and drives them with ``TPPeers``:

- two process groups of their own, built on a TCP store (so the engine needs no default process group
  and never touches a trainer's): the tensor group (NCCL on CUDA, gloo on CPU) for the model's
  collectives and weight broadcasts, and a gloo control group that carries rank 0's commands (pickled);
- weights (at start-up and on ``update_weights``): rank 0 broadcasts the full tensors, packed in
  buckets of ~256 MB (one command and one broadcast each), and every rank keeps its shard
  (``CausalLM.load_weights`` slices it);
- each step: rank 0's ``ModelRunner`` sends the step's host inputs (``PrefillStep`` / ``DecodeStep``,
  with the KV block copies), every rank runs the forward on its shard, the LM head gathers the logits
  and rank 0 samples from them (same code and seeds as one process). With async scheduling rank 0 sends
  decode step t+1 before step t's ids reach its host: the ranks take those ids from rank 0's device by a
  broadcast on the tensor group;
- ``sleep`` / ``wake_up`` / ``close`` are forwarded as commands.

A worker (``worker_main``) builds its model shard and KV cache, then loops on commands until ``stop``.

An engine may instead span N training processes that exist already (RL's hybrid engine with several
workers): ``colocated_group`` makes their groups out of the training world and ``GroupPeers`` gives every
rank a whole engine front over its shard; the ranks take turns driving generation (``take_turns``).
"""

from __future__ import annotations

import contextlib
import math
import pickle
import subprocess
import sys
import time
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tidal.rollout.models.parallel import TPGroup

HOST = "127.0.0.1"
TIMEOUT_S = 1800.0


@dataclass
class WorkerSpec:
    """What a worker needs to build its shard and runner (picklable)."""

    hf_config: Any
    max_model_len: int
    dtype: torch.dtype
    block_size: int
    max_num_seqs: int
    enforce_eager: bool
    attention_backend: str
    num_threads: int


def tp_devices(device: torch.device, size: int) -> list[torch.device]:
    """Rank r's device: the CPU for every rank, or the ``size`` GPUs from rank 0's on."""
    if device.type != "cuda":
        return [device] * size
    first = device.index or 0
    available = torch.cuda.device_count()
    if first + size > available:
        raise ValueError(
            f"tensor-parallel size {size} from {device} needs GPUs {first}..{first + size - 1} "
            f"but {available} are visible"
        )
    return [torch.device("cuda", first + r) for r in range(size)]


def open_groups(store: dist.Store, rank: int, size: int, device: torch.device):
    """(tensor-group ``TPGroup``, gloo control group) on prefixes of ``store``."""
    timeout = timedelta(seconds=TIMEOUT_S)
    tensor_store = dist.PrefixStore("tp_tensor", store)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(tensor_store, rank, size, opts)
    else:
        group = dist.ProcessGroupGloo(tensor_store, rank, size, timeout)
    control = dist.ProcessGroupGloo(dist.PrefixStore("tp_control", store), rank, size, timeout)
    return TPGroup(rank, size, group), control


class Channel:
    """Commands from one rank (``root``, rank 0 unless a colocated group's driver) to the others:
    pickled objects broadcast over the gloo control group."""

    def __init__(self, group):
        self.group = group

    def _broadcast(self, tensor: torch.Tensor, root: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        self.group.broadcast([tensor], opts).wait()

    def send(self, message, root: int = 0) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
        self._broadcast(torch.tensor([data.numel()], dtype=torch.int64), root)
        self._broadcast(data, root)

    def recv(self, root: int = 0):
        size = torch.zeros(1, dtype=torch.int64)
        self._broadcast(size, root)
        data = torch.empty(int(size), dtype=torch.uint8)
        self._broadcast(data, root)
        return pickle.loads(data.numpy().tobytes())


class Stopped(Exception):
    """Rank 0 closed the engine (also while a worker was still receiving weights)."""


# Weights travel in buckets of about this many bytes: one command and one broadcast per bucket, not per
# tensor (a 14B checkpoint has ~580 tensors; each command is a pickled message and a gloo round trip).
BUCKET_BYTES = 256 * 2**20
ALIGN = 16  # each tensor's offset in a bucket's bytes, so that any dtype can view its slice

TensorMeta = tuple[str, tuple[int, ...], torch.dtype]


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def bucket_offsets(meta: list[TensorMeta]) -> tuple[list[int], int]:
    """Each tensor's byte offset in its bucket (aligned), and the bucket's size."""
    offsets, end = [], 0
    for _, shape, dtype in meta:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + _nbytes(shape, dtype)
    return offsets, end


def pack(tensors: list[torch.Tensor], meta: list[TensorMeta]) -> torch.Tensor:
    """The bucket's bytes (a uint8 view of the tensor itself when the bucket holds one)."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1).view(torch.uint8)
    offsets, size = bucket_offsets(meta)
    flat = torch.empty(size, dtype=torch.uint8, device=tensors[0].device)
    for tensor, start in zip(tensors, offsets, strict=True):
        raw = tensor.reshape(-1).view(torch.uint8)
        flat[start : start + raw.numel()].copy_(raw)
    return flat


def unpack(flat: torch.Tensor, meta: list[TensorMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """``pack``'s inverse: (name, tensor) views of the bucket's bytes."""
    offsets, _ = bucket_offsets(meta)
    for (name, shape, dtype), start in zip(meta, offsets, strict=True):
        yield name, flat[start : start + _nbytes(shape, dtype)].view(dtype).view(shape)


def buckets(
    named: Iterable[tuple[str, torch.Tensor]], device: torch.device, limit: int | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``named`` on ``device`` (contiguous) in consecutive groups of about ``limit`` bytes (default
    ``BUCKET_BYTES``)."""
    limit = BUCKET_BYTES if limit is None else limit
    bucket, size = [], 0
    for name, tensor in named:
        full = tensor.to(device).contiguous()
        bucket.append((name, full))
        size += full.numel() * full.element_size()
        if size >= limit:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def receive_tensors(
    channel: Channel, tp: TPGroup, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """A worker's side of ``TPPeers.broadcasting``: each full tensor, until rank 0 says ``end``."""
    while True:
        message = channel.recv()
        if message[0] == "end":
            return
        if message[0] == "stop":  # rank 0 failed to build its shard and is closing the engine
            raise Stopped
        meta = message[1]
        flat = torch.empty(bucket_offsets(meta)[1], dtype=torch.uint8, device=device)
        yield from unpack(tp.broadcast(flat), meta)


class TPPeers:
    """Rank 0's handle on ranks 1..N-1: starts them, sends them weights, steps and commands."""

    def __init__(self, spec: WorkerSpec, devices: list[torch.device]):
        size = len(devices)
        self.device = devices[0]
        timeout = timedelta(seconds=TIMEOUT_S)
        store = dist.TCPStore(HOST, 0, size, True, timeout=timeout, wait_for_workers=False)
        store.set("spec", pickle.dumps(spec))
        command = [sys.executable, "-m", "tidal.rollout.runner.tp_worker", str(size), str(store.port)]
        self.procs = [subprocess.Popen([*command, str(rank), str(devices[rank])]) for rank in range(1, size)]
        self._store = store  # the workers' rendezvous lives as long as the engine
        self.channel = None
        try:
            self.wait_for("joined", "starting")
            self.tp, control = open_groups(store, 0, size, self.device)
        except BaseException:
            self.close()
            raise
        self.channel = Channel(control)

    def wait_for(self, key: str, doing: str) -> None:
        """Until every worker has set ``key`` in the store; a worker that exits first raises (its
        traceback is on stderr) instead of leaving rank 0 waiting on a collective."""
        pending = dict(enumerate(self.procs, start=1))
        while pending:
            for rank, proc in list(pending.items()):
                if self._store.check([f"{key}{rank}"]):
                    del pending[rank]
                elif proc.poll() is not None:
                    raise RuntimeError(
                        f"tensor-parallel engine rank {rank} exited (code {proc.returncode}) while {doing}"
                    )
            if pending:
                time.sleep(0.01)

    def broadcasting(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``named`` as rank 0 loads it, broadcast to the other ranks on the way, a bucket at a time."""
        for bucket in buckets(named, self.device):
            meta = [(name, tuple(t.shape), t.dtype) for name, t in bucket]
            self.channel.send(("tensors", meta))
            self.tp.broadcast(pack([t for _, t in bucket], meta))
            yield from bucket
        self.channel.send(("end",))

    def send_step(self, step) -> None:
        self.channel.send(("step", step))

    def send(self, *command) -> None:
        self.channel.send(command)

    def loading(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``update_weights``: the workers receive every tensor from rank 0."""
        self.send("load")
        return self.broadcasting(named)

    def sleep(self, level: int) -> None:
        self.send("sleep", level)

    def wake(self) -> None:
        self.send("wake")

    def take_turns(self, generate, runner):
        """Rank 0 is the only driver."""
        return generate()

    def close(self) -> None:
        """Stop the workers (they leave their loop and exit); kill any that do not."""
        if not self.procs:
            return
        if self.channel is not None and all(proc.poll() is None for proc in self.procs):
            with contextlib.suppress(RuntimeError):  # a worker already gone: killed below
                self.channel.send(("stop",))
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []


class GroupPeers:
    """A TP engine spanning a group of training processes (colocated with them; ``colocated_group``).

    Every rank holds a whole ``LLMEngine`` front (scheduler, sampler) over its shard and its KV cache,
    loads its shard from its own full tensors (each trainer gathers the policy anyway) and sleeps on its
    own. The ranks take turns as driver (``take_turns``): while one generates its share of the prompts
    and sends its steps, the others serve them on their shards; the KV cache is empty between turns."""

    def __init__(self, tp: TPGroup, control):
        self.tp, self.channel = tp, Channel(control)

    def agree_blocks(self, num_blocks: int) -> int:
        """The KV blocks every rank can hold (the driver's block tables must fit every rank's cache)."""
        counts = torch.tensor([num_blocks], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.channel.group.allreduce([counts], opts).wait()
        return int(counts)

    def send_step(self, step) -> None:
        self.channel.send(("step", step), root=self.tp.rank)

    def loading(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        return named

    def sleep(self, level: int) -> None:
        pass  # every rank's trainer puts its own engine to sleep

    def wake(self) -> None:
        pass

    def take_turns(self, generate, runner):
        """``generate()`` on this rank in its turn; the other ranks' turns served on ``runner``."""
        result, error = None, None
        for driver in range(self.tp.size):
            if driver == self.tp.rank:
                try:
                    result = generate()
                except Exception as err:  # still release the group and serve the later turns
                    error = err
                self.channel.send(("release",), root=driver)
                continue
            while (command := self.channel.recv(root=driver))[0] == "step":
                runner.forward_step(command[1])
        if error is not None:
            raise error
        return result

    def close(self) -> None:
        pass


def colocated_group(tp_size: int, device: torch.device) -> tuple[TPGroup, Any]:
    """This training process's TP engine group: ranks ``[g * tp_size, (g + 1) * tp_size)`` of the
    default (training) world, as a (model collectives, gloo control) pair. Collective over the world:
    every process creates every group, in the same order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    backend = "nccl" if device.type == "cuda" else "gloo"
    mine = None
    for first in range(0, world, tp_size):
        ranks = list(range(first, first + tp_size))
        groups = dist.new_group(ranks, backend=backend), dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            mine = TPGroup(rank - first, tp_size, groups[0]), groups[1]
    return mine


def worker_main(size: int, port: int, rank: int, device: str) -> None:
    """Rank ``rank`` of a TP engine: build the shard from rank 0's weights, then serve commands."""
    try:
        _serve(size, port, rank, torch.device(device))
    except Stopped:
        return
    except BaseException:
        traceback.print_exc()
        raise SystemExit(1) from None


def _serve(size: int, port: int, rank: int, device: torch.device) -> None:
    from tidal.rollout.models.loader import build_decoder
    from tidal.rollout.runner.model_runner import ModelRunner

    store = dist.TCPStore(HOST, port, size, False, timeout=timedelta(seconds=TIMEOUT_S))
    spec: WorkerSpec = pickle.loads(store.get("spec"))
    torch.set_num_threads(spec.num_threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store.set(f"joined{rank}", "1")
    tp, control = open_groups(store, rank, size, device)
    channel = Channel(control)
    weights = receive_tensors(channel, tp, device)
    model = build_decoder(spec.hf_config, weights, spec.max_model_len, spec.dtype, device, tp=tp)
    _, num_kv_blocks = channel.recv()
    runner = ModelRunner(
        model,
        spec.block_size,
        num_kv_blocks,
        set(),  # stop tokens matter to sampling only, which is rank 0's
        max_num_seqs=spec.max_num_seqs,
        max_model_len=spec.max_model_len,
        enforce_eager=spec.enforce_eager,
        attention_backend=spec.attention_backend,
        lookahead=True,  # two staging buffers: rank 0 may send a step launched ahead (async scheduling)
    )
    store.set(f"built{rank}", "1")
    asleep_level = 0
    while True:
        command = channel.recv()
        kind = command[0]
        if kind == "step":
            runner.forward_step(command[1])
        elif kind == "load":
            model.load_weights(receive_tensors(channel, tp, device))
        elif kind == "sleep":
            asleep_level = command[1]
            runner.free_kv_cache()
            if asleep_level == 2 and device.type != "cpu":
                model.to("cpu")
                torch.cuda.empty_cache()
        elif kind == "wake":
            if asleep_level == 2 and device.type != "cpu":
                model.to(device)
            if runner.kv_cache is None:
                runner.allocate_kv_cache()
            asleep_level = 0
        elif kind == "stop":
            return
        else:
            raise RuntimeError(f"unknown tensor-parallel engine command {kind!r}")


if __name__ == "__main__":
    worker_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
