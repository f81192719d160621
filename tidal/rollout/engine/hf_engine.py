"""``HFEngine``: any causal LM the native engine does not implement, generated with transformers.

tidal's ``LLMEngine`` runs the families of ``models/registry.py`` on its own paged-cache decoder. Every
other ``AutoModelForCausalLM`` (a hybrid Mamba such as ``bamba``, ``gpt2``, a family released after the
registry was written) runs here instead, behind the same interface, so that ``tidal generate``, ``serve``
and ``ppo`` accept it: ``generate``; the step-level ``add_request`` / ``step`` / ``abort`` /
``has_unfinished``; ``update_weights`` (HF names); ``sleep`` / ``wake_up``; ``take_turns``; ``close``;
the same ``RequestOutput``s (ids, log-probs, top log-probs, finish and stop reasons, text cut at stop
strings). The model is transformers' own with its own KV cache (``hf_engine_steps.py``: continuous
batching in its simplest form, each step prefills the new requests and advances every running one by one
token); sampling, seeds and stop rules are the native engine's, so for the same logits a seeded request
gets the same tokens. It is slower (no paged cache, no CUDA graphs, a forward per request per step).

``make_engine`` is what commands call: ``LLMEngine`` for a registry family, ``HFEngine`` otherwise.
The engine features the fallback lacks are refused in one line when asked for (``fallback_problem``).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from tidal.logging import get_logger
from tidal.rollout.engine.config import EngineConfig
from tidal.rollout.engine.hf_engine_steps import Cohort, HFStepper, StopRules
from tidal.rollout.engine.llm_engine import LLMEngine
from tidal.rollout.engine.loading import eos_token_ids, load_hf_config, load_tokenizer, resolve_model
from tidal.rollout.engine.requests import RequestBuilding
from tidal.rollout.models.registry import FAMILIES, VISION_FAMILIES
from tidal.rollout.outputs import RequestOutput
from tidal.rollout.runner.sampler import sequence_seed
from tidal.rollout.sampling_params import SamplingParams
from tidal.rollout.scheduling.sequence import Sequence

log = get_logger(__name__)


def fallback_notice(model_type: str | None) -> str:
    return f"{model_type}: not native to tidal's engine; generating with transformers (slower)"


def fallback_problem(config: EngineConfig, model_type: str | None) -> str | None:
    """The first engine feature ``config`` asks for that the transformers fallback lacks, in one line
    naming it and the family (None: the fallback can run ``config``). CUDA graphs are never asked for
    (they are the native engine's default): the fallback runs eagerly."""
    asked = {
        "tensor_parallel (tp_size > 1)": config.tp_size > 1,
        "prefix_caching": config.enable_prefix_caching,
        "chunked_prefill": config.enable_chunked_prefill,
        "exact_logprobs": config.exact_logprobs,
        "record_routing (MoE router replay)": config.record_routing,
        "async_scheduling": config.async_scheduling is True,
        "attention_backend triton": config.attention_backend == "triton",
        f"FP8 rollouts ({config.quantization})": config.quantization != "none",
        "an FP8 KV cache (kv_cache_dtype fp8)": config.kv_cache_dtype == "fp8",
    }
    feature = next((name for name, on in asked.items() if on), None)
    return None if feature is None else _refusal(feature, model_type)


def _refusal(feature: str, model_type: str | None) -> str:
    return (
        f"{feature} is not supported for the {model_type} family: it is not native to tidal's engine and "
        "runs on the transformers fallback, which lacks it"
    )


@dataclass
class _Args:
    """What callers read of a native model's ``args`` (``tidal serve`` checks prompt ids against it)."""

    vocab_size: int
    model_type: str | None


class HFEngine:
    """``LLMEngine``'s interface over a transformers ``AutoModelForCausalLM`` (module docstring).

    Built like ``LLMEngine``: a HF folder path, or ``model=`` (copied), or ``state_dict=`` with a path or
    ``hf_config``. ``tp_group`` (an engine spanning training processes) is refused: no tensor parallelism.
    Of ``EngineConfig`` it reads the device, dtype, seed, ``max_num_seqs`` (rows decoded together) and
    ``max_model_len``; the paged-cache sizes (``block_size``, ``num_kv_blocks``, memory budgets,
    ``max_num_batched_tokens``) have nothing to size here (the transformers cache grows per request).

    Request bookkeeping that does not depend on the model (``_params_per_prompt``, ``_encode``,
    ``_snapshot``) is ``LLMEngine``'s own code, called on this engine, which has the attributes it reads.
    """

    def __init__(
        self,
        model_path: str | Path | None = None,
        config: EngineConfig | None = None,
        *,
        model: torch.nn.Module | None = None,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        hf_config=None,
        tokenizer=None,
        tp_group: tuple | None = None,
    ):
        self.config, self.hf_config, model_type, self.device, self.dtype = resolve_model(
            model_path, config, model, hf_config
        )
        problem = fallback_problem(self.config, model_type)
        if problem is None and tp_group is not None:  # an engine spanning training processes
            problem = _refusal("tensor_parallel (tp_group)", model_type)
        if problem:
            raise ValueError(f"EngineConfig: {problem}")
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_path)
        self.max_model_len = self.config.max_model_len or getattr(
            self.hf_config, "max_position_embeddings", None
        )
        if not self.max_model_len:
            raise ValueError(f"{model_type}: the config names no max_position_embeddings; set max_model_len")
        log.warning(fallback_notice(model_type))
        self.model = self._load_model(model_path, model, state_dict)
        head = self.model.get_output_embeddings()
        vocab = head.weight.shape[0] if head is not None else self.hf_config.vocab_size
        self.model.args = _Args(vocab, model_type)
        self.eos_token_ids = eos_token_ids(self.hf_config, model_path, model, self.tokenizer)
        self.stepper = HFStepper(self.model)
        self.stop_rules = StopRules(self.max_model_len, self.eos_token_ids, self._detokenize)
        self.peers = None
        self.async_scheduling = False
        self.eager = True
        self._rng = random.Random(self.config.seed)
        self._next_seq_id = 0
        self._next_request_id = 0
        self._waiting: list[list[Sequence]] = []
        self._cohorts: list[Cohort] = []
        self._requests: dict[int, list[Sequence]] = {}  # step-level requests in flight, by id
        self.sleep_level = 0

    def _load_model(self, model_path, model, state_dict) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        if model is not None:
            loaded = copy.deepcopy(model)
        elif state_dict is not None:
            loaded = AutoModelForCausalLM.from_config(self.hf_config, dtype=self.dtype)
            self._copy_weights(loaded, state_dict.items())
        elif model_path is not None:
            try:
                loaded = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=self.dtype)
            except ValueError as err:
                if "Unrecognized configuration class" not in str(err):
                    raise
                raise ValueError(
                    f"model_type {self.hf_config.model_type!r} is neither a family of tidal's engine nor a "
                    "causal LM transformers can load (AutoModelForCausalLM)"
                ) from None
        else:
            raise ValueError("HFEngine needs a model folder path, a loaded model or a state_dict")
        loaded.requires_grad_(False)
        return loaded.to(device=self.device, dtype=self.dtype).eval()

    def take_turns(self, generate: Callable):
        """Run ``generate()`` (one process: no other ranks to take turns with)."""
        return generate()

    def close(self) -> None:
        """Nothing to stop (no worker processes)."""

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        if self.sleep_level:
            raise RuntimeError("HFEngine is asleep: call wake_up() before generate()")
        if self._requests:
            raise RuntimeError("HFEngine.generate: step-level requests are in flight (add_request/step)")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = LLMEngine._params_per_prompt(self, len(prompts), sampling_params)
        token_ids = [self._encode(i, p) for i, p in enumerate(prompts)]
        groups = [
            self._make_group(i, ids, p) for i, (ids, p) in enumerate(zip(token_ids, params, strict=True))
        ]
        self._waiting.extend(groups)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(groups), desc="rollout", unit="req")
        try:
            while self._waiting or self._cohorts:
                ended = {seq.request_index for seq in self._advance() if seq.is_finished}
                if bar is not None:  # requests whose last sample ended in this step
                    bar.update(sum(all(s.is_finished for s in groups[i]) for i in ended))
        except BaseException:
            self._abort_all()  # an interrupted call must not leak its sequences into the next one
            raise
        finally:
            if bar is not None:
                bar.close()
        return [
            RequestOutput(i, p if isinstance(p, str) else None, ids, [self._completion(s) for s in group])
            for i, (p, ids, group) in enumerate(zip(prompts, token_ids, groups, strict=True))
        ]

    def _advance(self) -> list[Sequence]:
        """One step: admit waiting groups while sequence slots last (prefilled now), advance the running
        ones by one token, apply the stop rules. Returns the sequences that sampled a token."""
        running = sum(len(c.seqs) for c in self._cohorts)
        admitted = []
        # Admission in arrival order while the rows fit; with nothing running the first group always fits
        # (``_make_group`` checks n <= max_num_seqs).
        while self._waiting and (running + len(self._waiting[0]) <= self.config.max_num_seqs or not running):
            admitted.append(self._waiting.pop(0))
            running += len(admitted[-1])
        new, (seqs, tokens, logprobs, tops) = self.stepper.step(admitted, self._cohorts)
        for seq, token, logprob, top in zip(seqs, tokens, logprobs, tops, strict=True):
            seq.append(token, logprob, top)
            self.stop_rules.check(seq)
        self._cohorts = [c for c in self._cohorts + new if c.drop_finished()]
        return seqs

    def _abort_all(self) -> None:
        self._waiting.clear()
        self._cohorts.clear()

    def _encode(self, index: int, prompt) -> list[int]:
        return LLMEngine._encode(self, index, prompt)

    def _make_group(self, index: int, ids: list[int], params: SamplingParams) -> list[Sequence]:
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"request {index}: n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"request {index}: stop strings need a tokenizer")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        group = []
        for sample in range(params.n):
            seq = Sequence(self._next_seq_id, index, sample, ids, params, sequence_seed(seed, sample))
            self.stop_rules.resolve(seq)
            group.append(seq)
            self._next_seq_id += 1
        return group

    # The native engine's: text cut at stop strings, the sample's ids and log-probs (no routing recorded).
    _detokenize = RequestBuilding._detokenize
    _completion = RequestBuilding._completion

    # ------------------------------------------------------------------ step-level API
    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None) -> int:
        """Queue one prompt (text or token ids) for the next ``step``; return its request id."""
        if self.sleep_level:
            raise RuntimeError("HFEngine is asleep: call wake_up() before add_request()")
        request_id = self._next_request_id
        ids = self._encode(request_id, prompt)
        group = self._make_group(request_id, ids, sampling_params or SamplingParams())
        self._next_request_id += 1
        self._requests[request_id] = group
        self._waiting.append(group)
        return request_id

    def has_unfinished(self) -> bool:
        """Whether any step-level request still has a sample to generate."""
        return bool(self._requests)

    def step(self, snapshot: Callable[[int], bool] | None = None) -> list[RequestOutput]:
        """Run one step; snapshots of the requests that sampled a token (``LLMEngine.step``)."""
        if not self._requests:
            return []
        try:
            seqs = self._advance()
        except BaseException:
            self._abort_all()
            self._requests.clear()
            raise
        outputs = []
        for request_id in dict.fromkeys(seq.request_index for seq in seqs):
            finished = all(seq.is_finished for seq in self._requests[request_id])
            if finished or snapshot is None or snapshot(request_id):
                outputs.append(LLMEngine._snapshot(self, request_id))
            if finished:
                del self._requests[request_id]
        return outputs

    def abort(self, request_id: int) -> bool:
        """Drop a step-level request; False when it is unknown or already finished."""
        group = self._requests.pop(request_id, None)
        if group is None:
            return False
        members = {seq.seq_id for seq in group}
        self._waiting = [g for g in self._waiting if g[0].seq_id not in members]
        for cohort in self._cohorts:
            for seq in cohort.seqs:
                if seq.seq_id in members:
                    seq.finish("abort")
        self._cohorts = [c for c in self._cohorts if c.drop_finished()]
        return True

    # ------------------------------------------------------------------ weights and memory
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping) -> int:
        """Copy HF-named tensors into the model in place; return how many were loaded. Tied embeddings
        share one tensor, so either name updates both; sharded DTensors are gathered."""
        if isinstance(named_tensors, Mapping):
            named_tensors = named_tensors.items()
        return self._copy_weights(self.model, named_tensors)

    @staticmethod
    def _copy_weights(model: torch.nn.Module, named_tensors) -> int:
        targets = dict(model.named_parameters(remove_duplicate=False))
        targets.update(model.named_buffers(remove_duplicate=False))
        count = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in targets:
                    raise ValueError(f"unexpected weight {name!r} for a {model.config.model_type} model")
                full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach()
                if tuple(full.shape) != tuple(targets[name].shape):
                    raise ValueError(
                        f"weight {name!r} has shape {tuple(full.shape)}, expected {tuple(targets[name].shape)}"
                    )
                targets[name].copy_(full)
                count += 1
        return count

    def sleep(self, level: int = 1) -> None:
        """Drop the requests' caches (level 1; no request survives a sleep); level 2 also moves the weights
        to the CPU."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self._abort_all()
        self._requests.clear()
        if level == 2 and self.device.type != "cpu":
            self.model.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the dropped caches' memory goes back to the trainer
        self.sleep_level = level

    def wake_up(self) -> None:
        if self.sleep_level == 2 and self.device.type != "cpu":
            self.model.to(self.device)
        self.sleep_level = 0

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_level > 0


def model_type_of(model_path=None, model=None, hf_config=None) -> str | None:
    """The ``model_type`` an engine would be built for, read from the config only."""
    return getattr(hf_config or load_hf_config(model_path, model), "model_type", None)


def make_engine(model_path: str | Path | None = None, config: EngineConfig | None = None, **kw):
    """The rollout engine for a checkpoint: tidal's ``LLMEngine`` for a family of its registry, the
    transformers fallback ``HFEngine`` (same interface, slower) for any other causal LM. Arguments are
    ``LLMEngine``'s."""
    hf_config = kw.get("hf_config") or load_hf_config(model_path, kw.get("model"))
    model_type = getattr(hf_config, "model_type", None)
    if model_type in FAMILIES or model_type in VISION_FAMILIES:
        return LLMEngine(model_path, config, **kw)
    if getattr(hf_config, "vision_config", None) is not None:  # the fallback would drop the images
        raise ValueError(
            f"{model_type} is a vision-language model: the rollout engine serves images for "
            f"{', '.join(sorted(VISION_FAMILIES))} only (the transformers fallback does not pass images)"
        )
    return HFEngine(model_path, config, **kw)
