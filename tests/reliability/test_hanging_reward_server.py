"""A reward server that accepts connections and never answers: the run fails quickly with one line
naming the URL (``--remote_rm_timeout``/``--remote_rm_retries``), instead of hanging for ~18 minutes."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from tidal.cli import train_ppo
from tidal.rewards import RemoteReward, RewardError


class SilentServer:
    """A loopback socket that accepts up to ``max_connections`` and holds them open, never answering."""

    def __init__(self, max_connections: int = 8):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.05)  # the accept loop checks ``done`` between waits, so it always ends
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/get_reward"
        self.accepted: list[socket.socket] = []
        self.max_connections = max_connections
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        while not self.done.is_set() and len(self.accepted) < self.max_connections:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.accepted.append(conn)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join(timeout=5)
        for conn in self.accepted:
            conn.close()
        self.sock.close()


def test_remote_reward_gives_up_after_timeout_and_retries():
    with SilentServer() as server:
        reward = RemoteReward(server.url, timeout=0.2, max_retries=1, backoff=0.0)
        with pytest.raises(RewardError) as info:
            reward(["q"], ["p"], ["l"])
        assert len(server.accepted) == 2  # one attempt and one retry, each accepted and left unanswered
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"reward server {server.url} did not answer within 0.2 s (2 attempts, ")
    assert "--remote_rm_timeout" in message


def test_ppo_run_against_silent_server_exits_with_one_line(tiny_qwen2, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}>", "label": str(i)}) + "\n" for i in range(4)))
    with SilentServer() as server:
        argv = [
            "--pretrain", str(tiny_qwen2), "--prompt_data", str(prompts), "--input_key", "prompt",
            "--label_key", "label", "--remote_rm_url", server.url, "--remote_rm_timeout", "0.2",
            "--remote_rm_retries", "1", "--n_samples_per_prompt", "2", "--rollout_batch_size", "4",
            "--train_batch_size", "8", "--micro_train_batch_size", "8", "--generate_max_len", "2",
            "--prompt_max_len", "8", "--init_kl_coef", "0", "--advantage_estimator", "group_norm",
            "--save_path", str(tmp_path / "final"), "--ckpt_path", str(tmp_path / "ckpt"),
        ]  # fmt: skip
        with pytest.raises(SystemExit) as info:
            train_ppo.main(argv)
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith(f"tidal ppo: error: reward server {server.url} did not answer within 0.2 s")
    assert not list(tmp_path.rglob("*.safetensors"))  # failed before the first step: nothing trained is saved
