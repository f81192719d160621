"""``load_reward_source``: turn ``--remote_rm_url`` into a ``RewardSource``.

``path/to/reward_func.py`` -> ``RewardFunction``; ``http(s)://...`` (comma-separated for several
servers) -> ``RemoteReward``. A file written for OpenRLHF may import ``from openrlhf.utils import
extract_boxed_answer, grade_answer``: while it loads, those names are tidal's (``openrlhf_compat``).
"""

from __future__ import annotations

from tidal.config.args import ConfigError
from tidal.rewards.base import RewardSource
from tidal.rewards.function import RewardFunction
from tidal.rewards.openrlhf_compat import openrlhf_imports
from tidal.rewards.remote import RemoteReward


def load_reward_source(remote_rm_url: str, **remote_kwargs) -> RewardSource:
    """A reward source for ``--remote_rm_url``; ``remote_kwargs`` (timeout, max_retries, backoff) go to
    ``RemoteReward``."""
    value = (remote_rm_url or "").strip()
    if value.endswith(".py"):
        with openrlhf_imports():
            return RewardFunction(value)
    urls = [u.strip() for u in value.split(",")]
    if value and all(u.startswith(("http://", "https://")) for u in urls):
        return RemoteReward(urls, **remote_kwargs)
    raise ConfigError(
        f"--remote_rm_url {remote_rm_url!r} is neither a Python file ending in .py (defining reward_func) "
        "nor a comma-separated list of http(s):// reward server URLs"
    )
