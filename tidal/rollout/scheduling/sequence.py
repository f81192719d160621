"""``Sequence``: one sample being generated (prompt + output ids, log-probs, KV block table, status)."""

from __future__ import annotations

import enum

from tidal.rollout.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """The state of one sample. ``token_ids`` holds prompt then output ids.

    KV invariant: while running, the cache holds keys/values for all tokens but the last one, which is
    the next decode step's input (its KV is written during that step). While a prompt is prefilled in
    chunks (or starts from cached prefix blocks), ``num_computed_tokens`` counts the leading tokens whose
    KV is already in the cache; the next prefill chunk starts there.

    ``block_table`` only grows in place (``append``); any other change assigns a new list, so that the
    runner can tell a changed table from the same list at the same length (``runner/steps.py``: ``BlockTables``).
    """

    # Slots: the engine reads a few of these for every sequence several times per step; stored in the
    # object itself they take fewer memory reads (and no attribute outside this list can appear).
    __slots__ = (
        "seq_id",
        "request_index",
        "sample_index",
        "params",
        "noise_seed",
        "token_ids",
        "num_prompt_tokens",
        "num_tokens",
        "max_num_tokens",
        "min_stop_tokens",
        "stop_ids",
        "output_logprobs",
        "output_top_logprobs",
        "block_table",
        "status",
        "finish_reason",
        "stop_reason",
        "routing",
        "num_computed_tokens",
        "block_hashes",
        "pending_copies",
        "cache_epoch",
        "state_slot",
        "mm",
    )

    def __init__(
        self,
        seq_id: int,
        request_index: int,
        sample_index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        noise_seed: int,
    ):
        self.seq_id = seq_id
        self.request_index = request_index
        self.sample_index = sample_index
        self.params = params
        self.noise_seed = noise_seed
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # ``len(token_ids)``, kept by ``append``: read for every sequence at every step (a plain attribute
        # costs a fraction of a property call there).
        self.num_tokens = self.num_prompt_tokens
        # The stop rules resolved once (``Scheduler.add`` sets them with the engine's eos ids and length
        # limit): the length at which it ends, the length from which a stop token can end it, and the ids
        # that do (eos unless ``ignore_eos``, and ``stop_token_ids``).
        self.max_num_tokens = self.num_prompt_tokens + params.max_new_tokens
        self.min_stop_tokens = self.num_prompt_tokens + params.min_new_tokens
        self.stop_ids: frozenset[int] = frozenset(params.stop_token_ids)
        self.output_logprobs: list[float] = []
        # SamplingParams.logprobs = k > 0: each output token's k (token id, log-prob) alternatives.
        self.output_top_logprobs: list[list[tuple[int, float]]] | None = [] if params.logprobs else None
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # Router replay: the experts each position's token was routed to ([MoE layers, k] per position),
        # when the engine records routing; the last token has none until a forward reads it.
        self.routing: list | None = None
        # Prefix caching / chunked prefill (unused otherwise): see the class docstring.
        self.num_computed_tokens = 0
        self.block_hashes: list[int] = []  # content hash of each full block so far (prefix_cache.py)
        self.pending_copies: list[tuple[int, int]] = []  # n > 1: copy-on-write due after the last chunk
        self.cache_epoch = 0  # the block manager's cache epoch when its blocks were allocated
        self.state_slot = -1  # linear-attention families: its recurrent-state slot (state_cache.py)
        self.mm = None  # vision families: the prompt's images and M-RoPE positions (multimodal.PromptImages)

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append(self, token_id: int, logprob: float, top: list[tuple[int, float]] | None = None) -> None:
        self.token_ids.append(token_id)
        self.num_tokens += 1
        self.output_logprobs.append(logprob)
        if self.output_top_logprobs is not None:
            self.output_top_logprobs.append(top[: self.params.logprobs])

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
