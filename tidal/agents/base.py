"""The agent interfaces users write against (seed-compatible) and the ``Trajectory`` they produce.

- ``AgentInstanceBase``: one environment episode, with async ``reset(states)`` and ``step(states)``.
  Its ``__init__`` may be ``async def`` (the seed's example declares it so); ``create_instance``
  handles both kinds.
- ``AgentExecutorBase``: turns prompts into trajectories. Subclasses implement ``execute`` for ONE
  sample; ``run`` executes ``n`` samples per prompt concurrently under asyncio, all sharing one
  ``LLMClient`` that batches their generation requests into single engine calls.

Token-in-token-out: a trajectory is built from token ids (prompt ids, then the engine's sampled ids and
the tokenized environment feedback); generated text is never re-tokenized, so the trainer scores
exactly the tokens that were sampled.

Per-episode failures: an ``EpisodeError`` raised while executing one sample (the agent's code raised,
a tool call did not parse, an unknown tool, a tool raised) ends THAT episode with reward 0 — keeping
the tokens generated so far, so a malformed tool call is trained on as a 0-reward action — and the
rollout goes on. ``run`` logs one warning per kind of failure with its count and first message, and
``rollout_logs`` counts them for the step's metrics (``agent/errors`` and ``agent/<kind>``). Everything
else an agent does wrong (a malformed return value, a non-finite reward) still stops the run.

Router replay (``--moe_router_replay``): when the engine records routing, every trajectory carries the
experts each of its tokens was routed to (``Trajectory.routed_experts``, aligned with ``token_ids``).
Executors add each engine answer's record with ``Trajectory.add_routing``; a token keeps the experts of
the FIRST forward that read it (prompt and observation tokens: the prefill that first read them;
sampled tokens: the decode step that read them, or the next turn's prefill for a turn's last token).
Tokens no forward read (the trajectory's last token, a final environment feedback) have no record and
route as the trainer's routers choose; they come after every trained token, so they change no trained
log-prob.

Prompt tokenization follows ``tidal.data.templates``: plain text is tokenized with
``add_special_tokens=True`` (a Llama-style tokenizer adds bos once), chat-rendered text with
``add_special_tokens=False``. Executors read ``self.add_special_tokens`` (default True); a trainer
that renders prompts with a chat template sets it to False.
"""

from __future__ import annotations

import abc
import asyncio
import contextvars
import dataclasses
import inspect
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from tidal.rewards.base import RewardError, check_finite
from tidal.rollout.runner.sampler import sequence_seed
from tidal.rollout.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tidal.agents.client import LLMClient

logger = logging.getLogger(__name__)


class AgentError(RuntimeError):
    """An agent or executor failed or returned something unusable; the message names its class and file."""


class EpisodeError(AgentError):
    """One episode failed; the executor ends it with reward 0 and the rollout goes on (see the module doc).

    ``kind`` names the metric that counts it: ``agent/<kind>`` (e.g. ``agent_errors``,
    ``tool_parse_errors``, ``unknown_tool_errors``, ``tool_errors``)."""

    def __init__(self, message: str, kind: str = "agent_errors"):
        super().__init__(message)
        self.kind = kind


class AgentInstanceBase:
    """One episode of an environment. Override ``reset`` and ``step`` (both async)."""

    async def reset(self, states: dict, **kwargs) -> dict:
        """``states``: ``observation`` (the prompt) and ``label``. Return ``{"observation": str}``."""
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs) -> dict:
        """``states``: ``observation_text`` (context before the action), ``action_text``, ``label``,
        ``sampling_params``. Return ``rewards``, ``scores``, ``environment_feedback`` (str appended to the
        context), ``done`` and optionally ``sampling_params`` (for the next turn) and ``extra_logs``."""
        raise NotImplementedError


async def create_instance(cls: type, kwargs: dict | None = None) -> Any:
    """Instantiate ``cls``, awaiting its ``__init__`` when it is ``async def`` (Python cannot call those)."""
    kwargs = kwargs or {}
    if inspect.iscoroutinefunction(cls.__init__):
        instance = cls.__new__(cls)
        await instance.__init__(**kwargs)
        return instance
    return cls(**kwargs)


def describe(obj_or_cls: Any) -> str:
    """``ClassName (path/to/file.py)`` for error messages."""
    cls = obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)
    try:
        source = inspect.getsourcefile(cls)
    except TypeError:
        source = None
    return f"{cls.__qualname__} ({source})" if source else cls.__qualname__


@dataclass
class Trajectory:
    """One sample: the prompt and everything after it, as the token ids the trainer will score."""

    prompt: str
    label: Any
    token_ids: list[int]  # prompt ids + every action and environment-feedback token
    action_mask: list[int]  # 1 on tokens the policy generated, 0 on prompt and feedback tokens
    rollout_logprobs: list[float]  # the engine's log-prob on action tokens, 0.0 elsewhere
    prompt_len: int
    response_text: str  # everything after the prompt, decoded
    reward: float | None = None  # None: single-turn, scored afterwards by a RewardSource
    score: float | None = None
    extra_logs: dict[str, float] = field(default_factory=dict)
    finish_reason: str = "stop"  # "stop"/"length" (engine, single-turn); "done"/"length"/"error" (agents)
    num_turns: int = 1
    error: str | None = None  # why the episode failed (an EpisodeError's message); None when it did not
    error_kind: str | None = None  # the EpisodeError's kind, counted as ``agent/<kind>``
    # --moe_router_replay: the engine's experts per token, [rows <= tokens, MoE layers, k] (see module doc)
    routed_experts: Any = None
    # RL with images: the prompt's (pixel_values, image_grid_thw) (tidal.experience.images), else None
    images: Any = None
    # --partial_rollout_enable: per token, the weight updates that had reached the engine since the rollout
    # started when it was sampled (tidal.placement.partial), else None
    weight_updates: list[int] | None = None

    @classmethod
    def start(cls, prompt: str, label: Any, prompt_ids: list[int]) -> Trajectory:
        """A trajectory holding only the prompt, to be extended with ``add_action`` / ``add_observation``."""
        n = len(prompt_ids)
        return cls(
            prompt, label, list(prompt_ids), [0] * n, [0.0] * n, n, "", finish_reason="length", num_turns=0
        )

    def add_action(self, token_ids: list[int], logprobs: list[float]) -> None:
        """Append tokens the policy sampled (trained on), with the engine's log-probs."""
        if len(token_ids) != len(logprobs):
            raise ValueError(f"{len(token_ids)} action tokens but {len(logprobs)} log-probs")
        self.token_ids += list(token_ids)
        self.action_mask += [1] * len(token_ids)
        self.rollout_logprobs += [float(x) for x in logprobs]

    def add_observation(self, token_ids: list[int]) -> None:
        """Append tokens the environment wrote (context only, not trained on)."""
        self.token_ids += list(token_ids)
        self.action_mask += [0] * len(token_ids)
        self.rollout_logprobs += [0.0] * len(token_ids)

    def add_routing(self, recorded: np.ndarray | None) -> None:
        """Router replay: extend ``routed_experts`` with an engine record (``CompletionOutput.routed_experts``
        of a request whose prompt was this trajectory's tokens so far) past the rows already held, so each
        token keeps the experts of the first forward that read it. ``None`` (no recording) is a no-op."""
        if recorded is None:
            return
        held = 0 if self.routed_experts is None else len(self.routed_experts)
        if self.routed_experts is None:
            self.routed_experts = np.array(recorded)
        elif len(recorded) > held:
            self.routed_experts = np.concatenate([self.routed_experts, recorded[held:]])

    def truncate(self, max_length: int) -> None:
        del self.token_ids[max_length:], self.action_mask[max_length:], self.rollout_logprobs[max_length:]
        if self.routed_experts is not None:
            self.routed_experts = self.routed_experts[:max_length]

    @property
    def response_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    def fail(self, err: EpisodeError) -> None:
        """End the episode on ``err``: reward and score 0, finish_reason "error"."""
        self.reward, self.score, self.finish_reason = 0.0, 0.0, "error"
        self.error, self.error_kind = str(err), err.kind

    def check(self) -> None:
        """Raise ValueError when the per-token lists disagree (a custom ``execute`` got them wrong)."""
        n = len(self.token_ids)
        if len(self.action_mask) != n or len(self.rollout_logprobs) != n:
            raise ValueError(
                f"token_ids ({n}), action_mask ({len(self.action_mask)}) and rollout_logprobs "
                f"({len(self.rollout_logprobs)}) must have the same length"
            )
        if self.routed_experts is not None and len(self.routed_experts) > n:
            raise ValueError(f"routed_experts has {len(self.routed_experts)} rows for {n} tokens")
        if not 0 < self.prompt_len <= n or any(self.action_mask[: self.prompt_len]):
            raise ValueError(f"prompt_len {self.prompt_len} must be in [1, {n}] and prompt tokens unmasked")
        # A failed episode may end before its first action; its row then trains nothing.
        if not any(self.action_mask) and self.error is None:
            raise ValueError("the trajectory has no action tokens")


def check_trajectory_rewards(trajectory: Trajectory) -> None:
    """An agent's reward and score, when set, pass the check every reward source goes through."""
    for what, value in (("reward", trajectory.reward), ("score", trajectory.score)):
        if value is not None:
            check_finite([value], what, where=lambda _: "the trajectory")


@dataclass(frozen=True)
class SampleIndex:
    """Where a sample sits in a rollout, for messages: prompt ``prompt`` (in the whole rollout), sample
    ``sample`` of its ``n``."""

    prompt: int
    sample: int
    n: int

    def __str__(self) -> str:
        return f"prompt {self.prompt}, sample {self.sample} of {self.n}"


def with_params(params: SamplingParams, **changes) -> SamplingParams:
    """``dataclasses.replace`` keeping the vLLM aliases in step: ``max_tokens`` would otherwise override
    a new ``max_new_tokens`` in ``SamplingParams.__post_init__``."""
    for name, alias in (("max_new_tokens", "max_tokens"), ("min_new_tokens", "min_tokens")):
        if alias in changes:
            changes[name] = changes.pop(alias)
        if name in changes:
            changes[alias] = changes[name]
    return dataclasses.replace(params, **changes)


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Params for sample ``index`` of a batch: n=1 and, when seeded, a distinct seed per sample."""
    seed = None if params.seed is None else sequence_seed(params.seed, index)
    return with_params(params, n=1, seed=seed)


# The images of the prompt whose episode runs in this task (its ``MultiModalInput``), None for a text
# prompt: an engine that carries prompt images (``tidal.experience.images.ImagePromptEngine``) gives each
# episode its prompt's, which ``MultiTurnAgentExecutor`` sends with every turn (``tidal.agents.images``).
PROMPT_IMAGES: contextvars.ContextVar[Any] = contextvars.ContextVar("PROMPT_IMAGES", default=None)


class AgentExecutorBase(abc.ABC):
    """Turns prompts into ``Trajectory``s. Override ``execute`` (one sample); call ``run`` (a batch)."""

    add_special_tokens: bool = True  # set False when prompts are chat-rendered (see the module doc)

    @abc.abstractmethod
    async def execute(
        self,
        prompt: str,
        label: Any,
        sampling_params: SamplingParams,
        llm: LLMClient,
        tokenizer,
        max_length: int,
    ) -> Trajectory:
        """Produce one trajectory of at most ``max_length`` tokens; ``sampling_params.n`` is 1."""

    def encode_prompt(self, tokenizer, text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=self.add_special_tokens)["input_ids"])

    def run(
        self,
        llm_engine,
        tokenizer,
        prompts: list[str],
        labels: list,
        sampling_params: SamplingParams,
        max_length: int,
        first_index: int = 0,
    ) -> list[Trajectory]:
        """``sampling_params.n`` trajectories per prompt, prompt-major (prompt 0's n samples first).

        ``first_index``: the batch's position in a larger one (a data-parallel rank's share), so
        each sample's seed follows its global index and the samples match a single-process run."""
        coro = self.arun(llm_engine, tokenizer, prompts, labels, sampling_params, max_length, first_index)
        return run_coroutine(coro)

    async def arun(self, llm_engine, tokenizer, prompts, labels, sampling_params, max_length, first_index=0):
        """``run`` for callers already inside an event loop."""
        from tidal.agents.client import LLMClient

        if len(prompts) != len(labels):
            raise ValueError(f"got {len(prompts)} prompts and {len(labels)} labels")
        client = LLMClient(llm_engine)
        n = sampling_params.n
        images = getattr(llm_engine, "prompt_images", None) or [None] * len(prompts)
        jobs = [
            self._execute_checked(
                prompt,
                label,
                sample_params(sampling_params, i * n + j),
                client,
                tokenizer,
                max_length,
                SampleIndex(i, j, n),
                images[i - first_index],
            )  # fmt: skip
            for i, (prompt, label) in enumerate(zip(prompts, labels, strict=True), start=first_index)
            for j in range(n)
        ]
        trajectories = list(await asyncio.gather(*jobs))
        if records_routing(llm_engine):
            complete_routing(trajectories, self)
        warn_episode_errors(trajectories)
        return trajectories

    async def _execute_checked(
        self, prompt, label, params, client, tokenizer, max_length, index: SampleIndex | None = None,
        prompt_images=None,
    ) -> Trajectory:  # fmt: skip
        PROMPT_IMAGES.set(prompt_images)  # this episode's task only (asyncio gives each its own context)
        where = f" ({index})" if index is not None else ""
        try:
            trajectory = await self.execute(prompt, label, params, client, tokenizer, max_length)
        except EpisodeError as err:  # failed before a trajectory existed: the prompt alone, reward 0
            trajectory = Trajectory.start(prompt, label, self.encode_prompt(tokenizer, prompt)[:max_length])
            trajectory.fail(err)
        except AgentError as err:
            raise AgentError(f"{err}{where}") from err
        if not isinstance(trajectory, Trajectory):
            raise AgentError(
                f"{describe(self)}.execute returned a {type(trajectory).__name__}, not a Trajectory{where}"
            )
        try:
            trajectory.check()
            check_trajectory_rewards(trajectory)
        except (ValueError, RewardError) as err:
            raise AgentError(
                f"{describe(self)}.execute returned a malformed Trajectory{where}: {err}"
            ) from err
        if len(trajectory.token_ids) > max_length:
            raise AgentError(
                f"{describe(self)}.execute returned {len(trajectory.token_ids)} tokens; max_length is "
                f"{max_length}{where}"
            )
        if trajectory.error is not None and where:
            trajectory.error += where
        return trajectory


def records_routing(engine) -> bool:
    """Whether ``engine`` records each token's experts (``EngineConfig.record_routing``: router replay)."""
    return bool(getattr(getattr(engine, "config", None), "record_routing", False))


def complete_routing(trajectories: list[Trajectory], executor: AgentExecutorBase) -> None:
    """Router replay needs every trajectory's experts. An episode that failed before its first action
    has no record: it gets an empty one (its row trains nothing); one with actions and no record comes
    from an ``execute`` that did not call ``add_routing``, which would silently train it unreplayed."""
    records = [t.routed_experts for t in trajectories if t.routed_experts is not None]
    for i, t in enumerate(trajectories):
        if t.routed_experts is not None:
            continue
        if any(t.action_mask):
            raise AgentError(
                f"{describe(executor)}.execute returned trajectory {i} without routed_experts; with "
                "--moe_router_replay call trajectory.add_routing(output.routed_experts) after each "
                "llm.generate (MultiTurnAgentExecutor does)"
            )
        if records:
            t.routed_experts = records[0][:0]


def warn_episode_errors(trajectories: list[Trajectory]) -> None:
    """One warning per kind of episode failure in this batch: how many, and the first one's message."""
    failed = [t for t in trajectories if t.error is not None]
    for kind in dict.fromkeys(t.error_kind for t in failed):
        of_kind = [t for t in failed if t.error_kind == kind]
        logger.warning(
            "agent: %d of %d episodes failed (%s), each ended with reward 0; first: %s",
            len(of_kind), len(trajectories), kind, of_kind[0].error,
        )  # fmt: skip


def rollout_logs(trajectories: list[Trajectory]) -> dict[str, float]:
    """The step's agent metrics: each agent ``extra_logs`` key averaged over the episodes that report it,
    and the number of failed episodes: ``agent/errors`` in all (logged, 0 included, whenever agents
    rewarded the episodes) and ``agent/<kind>`` per kind that occurred. With several processes the
    trainer averages these counts over the processes."""
    values: dict[str, list[float]] = {}
    for t in trajectories:
        for key, value in t.extra_logs.items():
            values.setdefault(key, []).append(value)
    logs = {key: sum(v) / len(v) for key, v in values.items()}
    kinds = [t.error_kind for t in trajectories if t.error is not None]
    if kinds or (trajectories and all(t.reward is not None for t in trajectories)):
        logs["agent/errors"] = float(len(kinds))
    logs |= {f"agent/{kind}": float(kinds.count(kind)) for kind in dict.fromkeys(kinds)}
    return logs


def run_coroutine(coro):
    """``asyncio.run`` that also works when called from inside a running loop (it then uses a thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()
