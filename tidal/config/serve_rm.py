"""``ServeRMConfig``: the flags of ``tidal serve_rm`` (the server itself is ``tidal.rewards.server``).

Kept apart from the server so that building the parser (``--help``) imports neither torch nor
transformers: ``tidal.rewards`` loads them when the server starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config.args import AT_LEAST_ONE, ConfigError, Range, arg


@dataclass
class ServeRMConfig:
    """Reward server: which reward model, where to listen, and how to batch."""

    reward_pretrain: str = arg(
        help="reward model folder (trained with tidal rm) to serve (required)", metavar="PATH"
    )
    host: str = arg("127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    port: int = arg(5000, help="port to listen on (0: any free port)")
    max_len: int = arg(2048, help="queries longer than this many tokens keep their last max_len tokens")
    batch_size: int = arg(16, help="most queries per forward pass; concurrent requests are coalesced")
    max_request_bytes: int = arg(
        16 * 1024 * 1024,
        help="largest request body in bytes; larger ones get HTTP 413 (tidal-only flag)",
        check=AT_LEAST_ONE,
    )
    max_request_queries: int = arg(
        8192, help="most queries in one request; more get HTTP 413 (tidal-only flag)", check=AT_LEAST_ONE
    )
    request_timeout: float = arg(
        60.0,
        help="seconds a client may stay silent while sending a request: a stalled body gets HTTP 408, "
        "stalled headers a closed connection (tidal-only flag)",
        check=Range(0, low_open=True),
    )
    normalize_reward: bool = arg(False, help="return (reward - mean) / std with the stats stored by tidal rm")
    value_head_prefix: str = arg(
        "score", help="attribute name of the value head", aliases=["--value_prefix_head"]
    )
    param_dtype: str = arg(
        "auto",
        help="compute dtype (auto: bf16 on CUDA, fp32 on CPU)",
        choices=("auto", "bf16", "fp16", "fp32"),
    )
    attn_implementation: str = arg(
        "sdpa", help="attention kernel passed to transformers", choices=("sdpa", "eager", "flash_attention_2")
    )
    packing_samples: bool = arg(
        False, help="score each micro-batch as one packed row (no padding; same rewards as padded batches)"
    )
    load_in_4bit: bool = arg(False, help="load the reward model's linear layers in 4-bit NF4 (bitsandbytes)")
    disable_fast_tokenizer: bool = arg(False, help="load the slow (Python) tokenizer")

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_len < 2:
            raise ConfigError("--batch_size must be >= 1 and --max_len >= 2")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(self.max_request_bytes, self.max_request_queries, self.request_timeout)


@dataclass(frozen=True)
class RequestLimits:
    """What one ``/get_reward`` request may hold (bigger ones are refused with 413), and how long its
    client may stay silent while sending it (``read_timeout`` seconds; a stalled body gets 408)."""

    max_bytes: int = 16 * 1024 * 1024
    max_queries: int = 8192
    read_timeout: float = 60.0
