"""``MultiTurnAgentExecutor``: run an ``AgentInstanceBase`` environment for several turns per sample.

Per sample: create the instance, ``reset({"observation": prompt, "label": label})``, tokenize the
observation (the prompt rule of ``AgentExecutorBase.encode_prompt``; a prompt with images, RL with
``--max_images_per_prompt``, keeps its images at their placeholders, which the reset observation must
keep: they go with every request), then loop:

1. generate an action from the current token ids (``max_new_tokens`` capped by what is left of
   ``max_length``) and append its ids (action_mask 1, the engine's log-probs);
2. ``step({"observation_text", "action_text", "action_token_ids", "label", "sampling_params"})``;
3. append the tokenized ``environment_feedback`` (``add_special_tokens=False``; action_mask 0): a str,
   or (tidal's addition, on a vision-language policy) a list of text and image content parts whose images
   go with every later turn's request and stay in the trajectory (``tidal.agents.images``);
4. stop when the step says ``done`` (finish_reason "done") or the context reaches ``max_length``
   (finish_reason "length"; the last feedback is truncated to fit). A returned ``sampling_params``
   applies from the next turn on.

Under router replay each turn's engine record extends the trajectory's ``routed_experts`` (each token
keeps the experts of the first forward that read it; see ``tidal.agents.base``).

When ``__init__``, ``reset`` or ``step`` raises (or raises ``EpisodeError`` itself, as the tool
executor's environment does for a malformed tool call), the episode ends there with reward 0 and
finish_reason "error", keeping the actions generated so far, and the rollout goes on (see
``tidal.agents.base``). A malformed ``step`` answer or a non-finite reward still stops the run.

Reward and score are those of the LAST step, as in OpenRLHF: environments that reward only at the
end return 0 before, and per-step shaping can be accumulated inside the environment. ``extra_logs``
are averaged over the steps that report each key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tidal.agents.base import (
    PROMPT_IMAGES,
    AgentError,
    AgentExecutorBase,
    EpisodeError,
    Trajectory,
    create_instance,
    describe,
    with_params,
)
from tidal.agents.images import ObservationImages, encode_feedback, feedback_parts, has_images
from tidal.rewards.base import RewardError, check_finite, to_scalar_logs
from tidal.rollout.runner.sampler import sequence_seed
from tidal.rollout.sampling_params import SamplingParams

_REQUIRED = ("rewards", "environment_feedback", "done")


@dataclass
class StepResult:
    """A validated ``step`` answer."""

    reward: float
    score: float
    feedback: list[tuple[str, Any]]  # ("text", str) / ("image", value) parts (tidal.agents.images)
    done: bool
    sampling_params: SamplingParams | None = None
    extra_logs: dict[str, float] = field(default_factory=dict)


def _prompt_images(llm, tokenizer, token_ids: list[int], where: str) -> ObservationImages | None:
    """The episode's images so far: its prompt's (``PROMPT_IMAGES``, at their placeholders in the reset
    observation's ids), or None for a text prompt (images may come with observations later)."""
    prompt = PROMPT_IMAGES.get()
    if prompt is None:
        return None
    images = ObservationImages(getattr(llm, "engine", None), tokenizer, f"{where} (the prompt's images)")
    images.add_prompt_images(prompt, token_ids, f"{where}.reset")
    return images


class MultiTurnAgentExecutor(AgentExecutorBase):
    """Executes ``agent_instance_cls`` episodes; the seed's ``AgentExecutor`` subclasses this."""

    def __init__(self, agent_instance_cls: type, instance_kwargs: dict | None = None):
        if not isinstance(agent_instance_cls, type):
            raise TypeError(f"MultiTurnAgentExecutor needs an agent class, got {agent_instance_cls!r}")
        self.agent_instance_cls = agent_instance_cls
        self.instance_kwargs = dict(instance_kwargs or {})

    def instance_kwargs_for(self, tokenizer) -> dict:
        """Keyword arguments of each new instance (subclasses add what needs the tokenizer)."""
        return self.instance_kwargs

    async def execute(self, prompt, label, sampling_params, llm, tokenizer, max_length) -> Trajectory:
        kwargs = self.instance_kwargs_for(tokenizer)
        agent = await self._call(create_instance(self.agent_instance_cls, kwargs), "__init__")
        observation = await self._reset(agent, prompt, label)
        traj = Trajectory.start(prompt, label, self.encode_prompt(tokenizer, observation))
        if traj.prompt_len >= max_length:
            raise AgentError(
                f"{describe(agent)}: the observation from reset has {traj.prompt_len} tokens, leaving no room "
                f"for an action under max_length={max_length}"
            )
        text, params, steps = observation, sampling_params, []
        images = _prompt_images(llm, tokenizer, traj.token_ids, describe(agent))  # then observations' too
        while len(traj.token_ids) < max_length and not (steps and steps[-1].done):
            turn_params = _turn_params(params, max_length - len(traj.token_ids), len(steps))
            with_images = {} if images is None else {"multi_modal": images.engine_input()}
            output = await llm.generate(traj.token_ids, turn_params, **with_images)
            traj.add_action(output.token_ids, output.logprobs)
            traj.add_routing(output.routed_experts)  # router replay; None unless the engine records
            action_text = _action_text(output, llm, tokenizer, turn_params)
            states = {
                "observation_text": text,
                "action_text": action_text,
                "action_token_ids": list(output.token_ids),  # tidal's addition: the sampled ids
                "label": label,
                "sampling_params": params,
            }
            try:
                result = await self._step(agent, states, params, turn=len(steps) + 1)
            except EpisodeError as err:  # the action stays in the trajectory, trained with reward 0
                traj.fail(err)
                break
            where = f"{describe(agent)}.step (turn {len(steps) + 1})"
            if images is None and has_images(result.feedback):
                images = ObservationImages(getattr(llm, "engine", None), tokenizer, where)
            ids, feedback = encode_feedback(result.feedback, tokenizer, images, len(traj.token_ids), where)
            traj.add_observation(ids)
            text += action_text + feedback
            params = result.sampling_params or params
            steps.append(result)
        traj.truncate(max_length)  # only the last feedback can overshoot: actions are capped to fit
        if images is not None:  # an image cut in part by the limit is dropped whole, with its tokens
            traj.truncate(images.fit(len(traj.token_ids)))
            traj.images = images.tensors()
        traj.response_text = tokenizer.decode(
            traj.response_ids, skip_special_tokens=sampling_params.skip_special_tokens
        )
        traj.extra_logs = _mean_logs([s.extra_logs for s in steps])
        traj.num_turns = len(steps) + (traj.error is not None)
        if traj.error is None:
            traj.reward, traj.score = steps[-1].reward, steps[-1].score
            traj.finish_reason = "done" if steps[-1].done else "length"
        return traj

    async def _call(self, awaitable, what: str):
        """Await the agent's code; what it raises fails this episode only (``EpisodeError``)."""
        try:
            return await awaitable
        except AgentError:
            raise
        except Exception as err:
            raise EpisodeError(
                f"{describe(self.agent_instance_cls)}.{what} raised {type(err).__name__}: {err}"
            ) from err

    async def _reset(self, agent, prompt: str, label: Any) -> str:
        answer = await self._call(agent.reset({"observation": prompt, "label": label}), "reset")
        observation = answer.get("observation") if isinstance(answer, dict) else None
        if not isinstance(observation, str) or not observation:
            raise AgentError(
                f"{describe(agent)}.reset returned {_show(answer)}; expected a dict with a non-empty "
                "str 'observation'"
            )
        return observation

    async def _step(self, agent, states: dict, params: SamplingParams, turn: int) -> StepResult:
        answer = await self._call(agent.step(states), "step")
        try:
            return _validate_step(answer, params, turn)
        except (TypeError, ValueError, RewardError) as err:
            raise AgentError(f"{describe(agent)}.step returned {_show(answer)}: {err}") from err


def _turn_params(params: SamplingParams, room: int, turn: int) -> SamplingParams:
    """This turn's params: n=1, at most ``room`` new tokens, and a per-turn seed when seeded (the
    engine's noise depends on (seed, position), so reusing one seed would repeat it every turn)."""
    max_new = min(params.max_new_tokens, room)
    seed = None if params.seed is None else sequence_seed(params.seed, turn)
    return with_params(
        params, n=1, max_new_tokens=max_new, min_new_tokens=min(params.min_new_tokens, max_new), seed=seed
    )


def _action_text(output, llm, tokenizer, params: SamplingParams) -> str:
    """The engine's text (cut at stop strings) when it has a tokenizer; else decoded here."""
    if getattr(llm, "tokenizer", None) is not None:
        return output.text
    return tokenizer.decode(output.token_ids, skip_special_tokens=params.skip_special_tokens)


def _validate_step(answer: Any, params: SamplingParams, turn: int = 1) -> StepResult:
    if not isinstance(answer, dict):
        raise TypeError(f"expected a dict with keys {list(_REQUIRED)}")
    missing = [k for k in _REQUIRED if k not in answer]
    if missing:
        raise ValueError(f"missing keys {missing}")
    feedback = feedback_parts(answer["environment_feedback"])
    # every turn's reward must be finite, not only the last one's (which the trajectory keeps)
    reward = _finite(_scalar(answer["rewards"], "rewards"), "reward", turn)
    score = (
        reward
        if answer.get("scores") is None
        else _finite(_scalar(answer["scores"], "scores"), "score", turn)
    )
    return StepResult(
        reward=reward,
        score=score,
        feedback=feedback,
        done=_flag(answer["done"]),
        sampling_params=_params(answer.get("sampling_params"), params),
        extra_logs=to_scalar_logs(answer.get("extra_logs") or {}, "extra_logs"),
    )


def _scalar(value: Any, name: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be one number, got a tensor of shape {list(value.shape)}")
        return float(value.item())
    if value is None or isinstance(value, (str, bytes, list, tuple, dict)):
        raise TypeError(f"{name} must be a number or a one-element tensor, got {type(value).__name__}")
    return float(value)


def _finite(value: float, what: str, turn: int) -> float:
    """``check_finite`` (shared by every reward source) on one step's reward or score."""
    return float(check_finite([value], what, where=lambda _: f"turn {turn}")[0])


def _flag(value: Any) -> bool:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return bool(value.item())
    if isinstance(value, bool) or type(value).__name__ == "bool_" or isinstance(value, int):
        return bool(value)
    raise TypeError(f"done must be a bool, got {type(value).__name__} {value!r}")


def _params(value: Any, current: SamplingParams) -> SamplingParams | None:
    if value is None:
        return None
    if isinstance(value, SamplingParams):
        return value
    if isinstance(value, dict):
        return with_params(current, **value)
    raise TypeError(
        f"sampling_params must be a SamplingParams, a dict of its fields or None, got {type(value).__name__}"
    )


def _mean_logs(per_step: list[dict[str, float]]) -> dict[str, float]:
    """Each key's mean over the steps that logged it."""
    values: dict[str, list[float]] = {}
    for logs in per_step:
        for key, value in logs.items():
            values.setdefault(key, []).append(value)
    return {key: sum(v) / len(v) for key, v in values.items()}


def _show(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
