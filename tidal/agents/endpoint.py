"""``--agent_endpoint``: black-box agent code against an OpenAI-compatible endpoint on the live policy.

The user's file defines ``agent(base_url, prompt, label) -> reward`` (``async def`` or plain ``def``;
a plain one runs on a worker thread). For each sample of a rollout the executor serves the rollout
engine with ``tidal.serve`` on 127.0.0.1 and calls ``agent`` with a base URL of its own,
``http://127.0.0.1:PORT/episodes/<id>/v1``: any HTTP client (the ``openai`` client with
``base_url=...``) works unchanged, and every request it makes is recorded under that episode, token in
and token out (``tidal.serve.recorder``). Concurrent episodes share the engine's continuous batching.
The server runs only while a rollout generates, so weight sync and sleep find the engine idle.

The episode's requests become one ``Trajectory`` from the recorded ids (never from re-tokenized
text): the first request's prompt ids are the prompt; each request's sampled ids are actions (with
the engine's log-probs); the ids a later request's prompt adds after the tokens so far are
observations (e.g. a tool result and the next chat header). It is then trained exactly like a
``step()`` agent's trajectory. An episode fails (reward 0, counted as ``agent/<kind>``, training goes
on) when ``agent`` raises (``agent_errors``), returns a non-number, makes no request, asks for
several samples in one request, or sends a prompt that does not extend the episode's tokens so far
(``endpoint_errors``: e.g. a chat template that re-renders earlier turns differently; send token-id
prompts to ``/v1/completions`` to keep full control). Under router replay each request's recorded
experts extend the trajectory's (``Trajectory.add_routing``), as for a ``step()`` agent.

Seeds: when the rollout is seeded (tidal's trainers always seed it), a request that carries no ``seed``
samples with ``sequence_seed(<episode seed>, k)``, k its number within the episode (0 for the first;
every well-formed request counts, seeded or not, in the order the server receives the episode's),
where the episode seed is the one ``AgentExecutorBase`` derives from the rollout seed and the sample's
(prompt, sample) index: the same noise as turn k of a built-in multi-turn agent. So an episode samples
the same tokens whatever order the concurrent episodes' requests reach the server in (an unseeded
request would otherwise take the engine's next seed in arrival order). A request with its own ``seed``
keeps it. An unseeded rollout leaves requests as they are. Episode ids stay random (uuid4): they only
route and record requests (a client kept from an earlier episode cannot reach a new one), and no seed
depends on them.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import threading
import uuid
from pathlib import Path
from typing import Any

from tidal.agents.base import AgentError, AgentExecutorBase, EpisodeError, Trajectory, describe, with_params
from tidal.rewards.function import load_python_file
from tidal.rollout.runner.sampler import sequence_seed
from tidal.serve.server import OpenAIServer, OpenAIService

EPISODE_PATH = re.compile(r"^/episodes/([A-Za-z0-9_.-]+)(/.*)$")


class EpisodeRoutes:
    """ASGI wrapper: ``/episodes/<id>/v1/...`` is served as ``/v1/...`` with ``X-Episode-Id: <id>``,
    so an episode's client only needs its base URL to be recorded under its id."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        match = EPISODE_PATH.match(scope.get("path", "")) if scope["type"] == "http" else None
        if match:
            episode, path = match.groups()
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"x-episode-id"]
            scope = dict(scope, path=path, raw_path=path.encode(),
                         headers=[*headers, (b"x-episode-id", episode.encode())])  # fmt: skip
        await self.app(scope, receive, send)


class EpisodeSeeds:
    """Thread-safe seeds of the open seeded episodes (the executor opens and closes them on its event
    loop; the server draws on its own): request k of an episode seeded s gets ``sequence_seed(s, k)``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._episodes: dict[str, list[int]] = {}  # episode id -> [episode seed, requests so far]

    def open(self, episode: str, seed: int | None) -> None:
        """Start counting ``episode``'s requests; an unseeded episode (``seed`` None) is not tracked."""
        if seed is not None:
            with self._lock:
                self._episodes[episode] = [seed, 0]

    def close(self, episode: str) -> None:
        with self._lock:
            self._episodes.pop(episode, None)

    def next_seed(self, episode: str | None) -> int | None:
        """The seed of ``episode``'s next request (counting it), or None for an untracked episode."""
        with self._lock:
            entry = self._episodes.get(episode) if episode is not None else None
            if entry is None:
                return None
            seed, k = entry
            entry[1] += 1
        return sequence_seed(seed, k)


class EpisodeService(OpenAIService):
    """An ``OpenAIService`` that gives an open episode's requests without a ``seed`` the episode's."""

    def __init__(self, engine, recorder, default_max_tokens: int, seeds: EpisodeSeeds):
        super().__init__(engine, "policy", default_max_tokens, recorder)
        self.seeds = seeds

    def _parse(self, raw: bytes, endpoint: str, episode: str | None):
        req = super()._parse(raw, endpoint, episode)
        if req.multi_modal is not None:  # the recorder keeps ids only: the trainer would miss the pixels
            from tidal.serve.schema import RequestError

            raise RequestError(
                "--agent_endpoint episodes take text only: images in requests are not yet recorded for "
                "training (an --agent_func_path agent may return images in its observations)",
                param="messages",
            )
        return req

    async def _serve(self, req):
        seed = self.seeds.next_seed(req.episode_id)  # every request of the episode counts, seeded or not
        if seed is not None and req.params.seed is None:
            req.params = with_params(req.params, seed=seed)
        return await super()._serve(req)


def episode_server(engine, recorder, default_max_tokens: int, seeds: EpisodeSeeds | None = None):
    """An ``OpenAIServer`` on ``engine`` (127.0.0.1, a free port) whose routes take episode prefixes;
    with ``seeds``, an open episode's requests without a ``seed`` get the episode's (module doc)."""
    import uvicorn

    server = OpenAIServer.__new__(OpenAIServer)
    server.service = EpisodeService(engine, recorder, default_max_tokens, seeds or EpisodeSeeds())
    config = uvicorn.Config(
        EpisodeRoutes(server.service.app), host="127.0.0.1", port=0, log_level="warning", lifespan="on"
    )
    server._server, server._thread = uvicorn.Server(config), None
    return server


def load_agent_function(path: str | Path):
    """The ``agent`` function of an ``--agent_endpoint`` file."""
    module = load_python_file(path, "--agent_endpoint", AgentError)
    func = getattr(module, "agent", None)
    if not callable(func):
        raise AgentError(
            f"--agent_endpoint {path} defines no function agent(base_url, prompt, label) -> reward"
        )
    return func


def trajectory_from_requests(prompt: str, label: Any, requests, tokenizer, max_length: int) -> Trajectory:
    """One episode's recorded requests (arrival order) as a trajectory of their token ids."""
    if not requests:
        raise EpisodeError("the agent made no request to its base_url", kind="endpoint_errors")
    traj = Trajectory.start(prompt, label, requests[0].prompt_token_ids[:max_length])
    traj.num_turns = 0
    for k, request in enumerate(requests):
        ids = request.prompt_token_ids
        problem = None
        if len(request.samples) != 1:
            problem = f"request {k + 1} asked for {len(request.samples)} samples (n); an episode takes n=1"
        elif k and ids[: len(traj.token_ids)] != traj.token_ids:
            problem = (
                f"request {k + 1}'s prompt does not extend the episode's tokens so far (re-rendered or "
                "edited history); send token-id prompts to /v1/completions to keep it"
            )
        if problem:
            traj.fail(EpisodeError(problem, kind="endpoint_errors"))
            break
        traj.add_observation(ids[len(traj.token_ids) :])
        sample = request.samples[0]
        traj.add_action(sample.token_ids, sample.logprobs)
        traj.add_routing(sample.routed_experts)  # router replay; None unless the engine records
        traj.num_turns += 1
        traj.finish_reason = sample.finish_reason
        if len(traj.token_ids) >= max_length:
            traj.truncate(max_length)
            traj.finish_reason = "length"
            break
    traj.response_text = tokenizer.decode(traj.response_ids, skip_special_tokens=True)
    return traj


class EndpointAgentExecutor(AgentExecutorBase):
    """Runs ``agent(base_url, prompt, label)`` per sample against a server on the rollout engine."""

    def __init__(self, func, source: str = "agent"):
        self.func, self.source = func, source
        self._url: str | None = None
        self._recorder = None
        self._seeds = EpisodeSeeds()

    @classmethod
    def from_file(cls, path: str | Path) -> EndpointAgentExecutor:
        return cls(load_agent_function(path), str(path))

    def run(self, llm_engine, tokenizer, prompts, labels, sampling_params, max_length, first_index=0):
        from tidal.serve.recorder import RequestRecorder

        self._recorder = RequestRecorder()
        server = episode_server(llm_engine, self._recorder, sampling_params.max_new_tokens, self._seeds)
        with server:
            self._url = server.base_url.removesuffix("/v1")
            try:
                return super().run(
                    llm_engine, tokenizer, prompts, labels, sampling_params, max_length, first_index
                )
            finally:
                self._url = None

    async def execute(self, prompt, label, sampling_params, llm, tokenizer, max_length) -> Trajectory:
        if self._url is None:
            raise AgentError(f"{describe(self)}: episodes run inside run(), which serves the engine")
        episode = uuid.uuid4().hex
        self._seeds.open(episode, sampling_params.seed)  # this sample's seed (AgentExecutorBase.arun)
        try:
            reward = await self._call(f"{self._url}/episodes/{episode}/v1", prompt, label)
        finally:
            self._seeds.close(episode)
        traj = trajectory_from_requests(prompt, label, self._recorder.pop(episode), tokenizer, max_length)
        if traj.error is None:
            traj.reward = traj.score = reward
        return traj

    async def _call(self, base_url: str, prompt: str, label) -> float:
        try:
            if inspect.iscoroutinefunction(self.func):
                value = await self.func(base_url, prompt, label)
            else:
                value = await asyncio.to_thread(self.func, base_url, prompt, label)
        except Exception as err:  # the user's code failed: this episode only
            raise EpisodeError(f"agent in {self.source} raised {type(err).__name__}: {err}") from err
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise EpisodeError(f"agent in {self.source} returned a {type(value).__name__}; expected a number")
        return float(value)
