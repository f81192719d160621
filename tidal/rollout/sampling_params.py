"""``SamplingParams``: how one request is sampled (vLLM's names and defaults where they exist).

Log-prob semantics (what an RL trainer must recompute to line up importance-sampling corrections):
the per-token log-prob returned with every sampled token is ``log_softmax(logits / temperature)[token]``
of the model's *unmodified* logits, i.e. taken BEFORE top-k / top-p / min-p truncation and before the
``min_new_tokens`` suppression of stop tokens, and before the repetition penalty. With
``temperature == 0`` (greedy) it is the raw ``log_softmax(logits)[token]``.

``logprobs=k`` adds, per sampled token, the k most likely tokens of that same distribution (after
temperature, before truncation): vLLM returns the raw-logit log-softmax there by default; tidal keeps the
alternatives consistent with the sampled token's own log-prob, so the sampled token, when among them,
carries the same value.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Sampling settings of one request; ``n`` samples share one prefill of the prompt.

    - ``temperature``: 0 means greedy (argmax); otherwise logits are divided by it.
    - ``top_k``: keep the k most likely tokens; -1 or 0 turns it off.
    - ``top_p``: nucleus sampling, keep the smallest set of tokens whose probability reaches ``top_p``.
    - ``min_p``: drop tokens whose probability is below ``min_p`` times the most likely one's.
    - ``max_new_tokens`` (alias ``max_tokens``) / ``min_new_tokens`` (alias ``min_tokens``): output length
      bounds; before ``min_new_tokens`` are produced, eos and ``stop_token_ids`` cannot be sampled.
    - ``stop_token_ids``: extra tokens that end a sample (the token is kept in the output ids).
    - ``stop``: strings that end a sample; the returned text is cut before the stop string (unless
      ``include_stop_str_in_output``) while ``token_ids``/``logprobs`` keep every sampled token, up to and
      including the one that completed the stop string, because that is what the policy actually produced.
    - ``ignore_eos``: keep generating past the model's eos tokens (benchmarks).
    - ``repetition_penalty``: Hugging Face's and vLLM's: the logit of every token already in the prompt
      or the output is divided by it when positive and multiplied by it when negative (> 1 discourages
      repeats, 1 is off); it changes which token is sampled, not the returned log-probs.
    - ``n``: samples per prompt; the prompt is prefilled once and its KV cache blocks are shared.
    - ``logprobs`` (vLLM's name): with k > 0, each output token also gets its k most likely alternatives
      (``CompletionOutput.top_logprobs``); None or 0 computes none.
    - ``seed``: same seed -> same outputs; noise is derived from (seed, sample index, output position),
      so it does not depend on which other requests share the batch. Unseeded requests draw a seed from
      the engine's seeded generator, so a fixed engine seed and request list also reproduce.

    The per-token ``logprobs`` of each output are documented in the module docstring: log_softmax of
    ``logits / temperature`` (raw logits when greedy) of the sampled token, before any truncation.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 16
    min_new_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    # vLLM spellings; when given they override the *_new_tokens fields and are kept equal to them.
    max_tokens: int | None = None
    min_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None:
            self.max_new_tokens = self.max_tokens
        if self.min_tokens is not None:
            self.min_new_tokens = self.min_tokens
        self.max_tokens, self.min_tokens = self.max_new_tokens, self.min_new_tokens
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.top_k == 0:
            self.top_k = -1
        self._validate()

    def _validate(self) -> None:
        checks = [
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k == -1 or self.top_k >= 1, f"top_k must be -1, 0 (off) or >= 1, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}"),
            (
                0 <= self.min_new_tokens <= self.max_new_tokens,
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}",
            ),
            (all(s for s in self.stop), "stop strings must be non-empty"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.logprobs is None or self.logprobs >= 0, f"logprobs must be >= 0, got {self.logprobs}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"SamplingParams: {message}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalizes_repetition(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def num_top_logprobs(self) -> int:
        """How many alternatives each output token gets (0: none)."""
        return self.logprobs or 0

    @property
    def needs_truncation(self) -> bool:
        """Whether top-k / top-p / min-p change the distribution (lets the sampler skip a sort)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0
