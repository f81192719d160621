"""``SingleTurnAgentExecutor``: the default executor (no ``--agent_func_path``): one response per sample.

``run`` makes ONE ``engine.generate`` call for the whole batch with ``SamplingParams(n=...)`` per
prompt, so the engine prefills each prompt once and shares its KV blocks among the n samples.
Trajectories come back prompt-major with ``reward=None``: the trainer scores them afterwards with a
``RewardSource`` (``queries = prompt + response_text``).
"""

from __future__ import annotations

from tidal.agents.base import AgentExecutorBase, Trajectory, with_params
from tidal.rollout.outputs import CompletionOutput
from tidal.rollout.runner.sampler import sequence_seed
from tidal.rollout.sampling_params import SamplingParams


class SingleTurnAgentExecutor(AgentExecutorBase):
    """Prompt in, one generated response out; rewards come later from a reward source."""

    def run(
        self, llm_engine, tokenizer, prompts, labels, sampling_params, max_length, first_index: int = 0
    ) -> list[Trajectory]:
        if len(prompts) != len(labels):
            raise ValueError(f"got {len(prompts)} prompts and {len(labels)} labels")
        prompt_ids = [self.encode_prompt(tokenizer, p) for p in prompts]
        params = [
            _prompt_params(sampling_params, first_index + i, len(ids), max_length)
            for i, ids in enumerate(prompt_ids)
        ]
        outputs = llm_engine.generate(prompt_ids, params)
        engine_decodes = getattr(llm_engine, "tokenizer", None) is not None
        return [
            _trajectory(prompt, label, ids, completion, tokenizer, sampling_params, engine_decodes)
            for prompt, label, ids, output in zip(prompts, labels, prompt_ids, outputs, strict=True)
            for completion in output.outputs
        ]

    async def execute(self, prompt, label, sampling_params, llm, tokenizer, max_length) -> Trajectory:
        """One sample through the batching ``LLMClient`` (used when called per sample)."""
        ids = self.encode_prompt(tokenizer, prompt)
        completion = await llm.generate(
            ids, _prompt_params(sampling_params, 0, len(ids), max_length, reseed=False)
        )
        engine_decodes = getattr(llm, "tokenizer", None) is not None
        return _trajectory(prompt, label, ids, completion, tokenizer, sampling_params, engine_decodes)


def _prompt_params(
    params: SamplingParams, index: int, prompt_len: int, max_length: int, reseed: bool = True
) -> SamplingParams:
    """Cap new tokens at what ``max_length`` leaves; give each prompt its own seed (the engine derives
    the n samples' seeds from it), so equal seeds do not repeat the same noise across prompts."""
    room = max_length - prompt_len
    if room < 1:
        raise ValueError(
            f"prompt {index} has {prompt_len} tokens, leaving no room for a response under max_length={max_length}"
        )
    max_new = min(params.max_new_tokens, room)
    seed = params.seed if params.seed is None or not reseed else sequence_seed(params.seed, index)
    return with_params(
        params, max_new_tokens=max_new, min_new_tokens=min(params.min_new_tokens, max_new), seed=seed
    )


def _trajectory(prompt, label, prompt_ids, completion: CompletionOutput, tokenizer, params, engine_decodes):
    traj = Trajectory.start(prompt, label, prompt_ids)
    traj.add_action(completion.token_ids, completion.logprobs)
    traj.routed_experts = completion.routed_experts  # None unless the engine records routing
    # The engine's text is cut at stop strings (vLLM's behaviour); decode here only when it has no tokenizer.
    traj.response_text = (
        completion.text
        if engine_decodes
        else tokenizer.decode(completion.token_ids, skip_special_tokens=params.skip_special_tokens)
    )
    traj.finish_reason, traj.num_turns = completion.finish_reason, 1
    return traj
