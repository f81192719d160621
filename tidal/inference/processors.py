"""Post-processors of ``tidal generate --post_processor``: turn a prompt's scored samples into training rows.

Each processor takes one ``PromptGroup`` (the rendered prompt, its K sampled responses and their
rewards) and returns the JSONL rows written for it, with OpenRLHF's semantics and keys:

- ``rs`` — rejection sampling / best-of-N (Llama 2, arXiv 2307.09288): the highest-reward sample,
  ``{"input", "output", "reward"}``, ready for ``tidal sft --input_key input --output_key output``.
- ``csft`` — conditional SFT (arXiv 2308.12050, SteerLM arXiv 2310.05344): every sample, with its
  reward written into the prompt by the reward template (default ``"{input} <rm_score>: {reward} "``,
  reward formatted ``{:.1f}``), ``{"input", "output", "reward"}``.
- ``iter_dpo`` — iterative DPO (RLHFlow, arXiv 2405.07863): the best sample as ``chosen`` and the
  worst as ``rejected``, ``{"prompt", "chosen", "rejected", "chosen_reward", "rejected_reward"}``.

Without a processor every sample is written (``{"input", "output"}`` plus ``"reward"`` when scored).

Samples are grouped by prompt *position* in the dataset, not by prompt text as OpenRLHF does, so two
identical prompts in the data stay two groups. Ties go to the earliest sample.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tidal.config.args import ConfigError

DEFAULT_REWARD_TEMPLATE = "{input} <rm_score>: {reward} "


@dataclass
class PromptGroup:
    """One prompt's samples: ``rewards`` is None when no reward model scored them."""

    prompt: str
    outputs: list[str]
    rewards: list[float] | None = None


PostProcessor = Callable[[PromptGroup], list[dict]]


def check_reward_template(template: str) -> None:
    """The template must place both the prompt and the reward (``--reward_template``)."""
    missing = [key for key in ("{input}", "{reward}") if key not in template]
    if missing:
        raise ConfigError(f"--reward_template must contain {' and '.join(missing)}, got {template!r}")


def reward_tag(template: str, prompt: str, reward: float) -> str:
    """``template`` with the prompt and the reward (one decimal, as OpenRLHF) filled in."""
    # str.replace, not str.format: prompts may contain braces (code, JSON).
    return template.replace("{reward}", f"{reward:.1f}").replace("{input}", prompt)


def keep_all(group: PromptGroup) -> list[dict]:
    if group.rewards is None:
        return [{"input": group.prompt, "output": out} for out in group.outputs]
    return [
        {"input": group.prompt, "output": out, "reward": r}
        for out, r in zip(group.outputs, group.rewards, strict=True)
    ]


def rejection_sampling(group: PromptGroup) -> list[dict]:
    best = _argmax(_rewards(group))
    return [{"input": group.prompt, "output": group.outputs[best], "reward": group.rewards[best]}]


def iterative_dpo(group: PromptGroup) -> list[dict]:
    rewards = _rewards(group)
    best, worst = _argmax(rewards), _argmin(rewards)
    return [
        {
            "prompt": group.prompt,
            "chosen": group.outputs[best],
            "rejected": group.outputs[worst],
            "chosen_reward": rewards[best],
            "rejected_reward": rewards[worst],
        }
    ]


def conditional_sft(template: str) -> PostProcessor:
    check_reward_template(template)

    def process(group: PromptGroup) -> list[dict]:
        return [
            {"input": reward_tag(template, group.prompt, r), "output": out, "reward": r}
            for out, r in zip(group.outputs, _rewards(group), strict=True)
        ]

    return process


# name → factory taking the reward template (only csft uses it).
POST_PROCESSORS: dict[str, Callable[[str], PostProcessor]] = {
    "rs": lambda template: rejection_sampling,
    "csft": conditional_sft,
    "iter_dpo": lambda template: iterative_dpo,
}


def make_post_processor(name: str | None, reward_template: str = DEFAULT_REWARD_TEMPLATE) -> PostProcessor:
    """The processor called ``name`` (None: write every sample)."""
    if name is None:
        return keep_all
    if name not in POST_PROCESSORS:
        raise ConfigError(f"--post_processor must be one of {sorted(POST_PROCESSORS)}, got {name!r}")
    return POST_PROCESSORS[name](reward_template)


def _rewards(group: PromptGroup) -> list[float]:
    if group.rewards is None:
        raise ConfigError("this --post_processor needs rewards: pass --reward_pretrain")
    return group.rewards


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


def _argmin(values: list[float]) -> int:
    return min(range(len(values)), key=lambda i: (values[i], i))
