"""OpenRLHF v0.9.2's and v0.11.0's example training scripts (``tests/cli/openrlhf_example_scripts.py``)
on tidal, with only model/data/output paths, sizes and the launcher changed.

Every script's flags parse and build its run config (nothing loads: a fraction of a second each); an SFT,
a DPO, a GRPO with a reward function and the VLM GRPO of v0.11.0 train one tiny step end to end. Sizes
(``SIZES``) are OpenRLHF's size flags made small, GPUs and nodes become one CPU process, and the launcher
is one in-process call of the tidal module's ``main`` (``openrlhf.cli.X`` → ``tidal.cli.X``). The
rejection-sampling, conditional-SFT and iterative-DPO scripts run in ``test_openrlhf_scripts.py``.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from tests.cli.openrlhf_example_scripts import SCRIPTS, Script

# OpenRLHF's size flags (both spellings) → the values used here; every other value is the script's.
SIZES = {
    **dict.fromkeys(["--max_len", "--data.max_len"], "48"),
    "--prompt_max_len": "32",
    **dict.fromkeys(["--generate_max_len", "--rollout.max_new_tokens"], "4"),
    **dict.fromkeys(["--train_batch_size", "--train.batch_size"], "4"),
    **dict.fromkeys(["--micro_train_batch_size", "--train.micro_batch_size"], "2"),
    **dict.fromkeys(["--rollout_batch_size", "--rollout.batch_size"], "4"),
    **dict.fromkeys(["--micro_rollout_batch_size", "--rollout.micro_batch_size"], "2"),
    **dict.fromkeys(["--n_samples_per_prompt", "--rollout.n_samples_per_prompt"], "2"),
    **dict.fromkeys(["--max_samples", "--data.max_samples"], "4"),
    **dict.fromkeys(["--max_epochs", "--train.max_epochs", "--num_episodes", "--train.num_episodes"], "1"),
    **dict.fromkeys(["--train_max_tokens_per_gpu", "--train.max_tokens_per_gpu"], "256"),
    **dict.fromkeys(["--rollout_max_tokens_per_gpu", "--rollout.max_tokens_per_gpu"], "256"),
    **dict.fromkeys(["--vllm_num_engines", "--vllm.num_engines"], "1"),
    **dict.fromkeys(["--vllm_tensor_parallel_size", "--vllm.tensor_parallel_size"], "1"),
    **dict.fromkeys(["--ring_attn_size", "--ds.ring_attn_size"], "1"),
    **dict.fromkeys(["--ring_head_stride", "--ds.ring_attn_head_stride"], "1"),
    "--eval.n_samples_per_prompt": "1",
    "--batch_size": "2",
    **{f"--{role}{sep}num_nodes": "1" for role in ("ref", "reward", "critic", "actor") for sep in "_."},
    **{
        f"--{role}{sep}num_gpus_per_node": "1"
        for role in ("ref", "reward", "critic", "actor")
        for sep in "_."
    },
}
TIDAL_PARSERS = {  # OpenRLHF module → (tidal module, its function that builds the run from flags)
    "openrlhf.cli.train_ppo_ray": ("tidal.cli.train_ppo", "parse_run"),
    "openrlhf.cli.serve_rm": ("tidal.cli.serve_rm", "parse_config"),
}
QUESTIONS = ["1+1=", "2+3=", "4+4=", "5+1="]
# A deterministic dense reward (the scripts' reward_func.py draws random 0/1 rewards): the share of
# vowels in the response, strictly between 0 and 1 for most samples, so --dynamic_filtering keeps groups.
REWARD_FN = """
import torch


def reward_func(queries, prompts, labels, **kwargs):
    shares = []
    for query, prompt in zip(queries, prompts):
        response = query[len(prompt):]
        shares.append(sum(c in "aeiou" for c in response) / max(len(response), 1))
    rewards = torch.tensor(shares)
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"vowel_share": rewards}}
"""
# A boxed-answer reward as OpenRLHF's math examples write one (OpenRLHF's names, tidal's grading).
MATH_FN = """
import torch
from openrlhf.utils import extract_boxed_answer, grade_answer


def reward_func(queries, prompts, labels, **kwargs):
    rewards = [float(grade_answer(extract_boxed_answer(q[len(p):]), label)) for q, p, label in
               zip(queries, prompts, labels)]
    return {"rewards": torch.tensor(rewards), "scores": torch.tensor(rewards)}
"""
AGENT_FN = """
from openrlhf.utils import grade_answer
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    async def __init__(self, *args, **kwargs):
        pass

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        reward = float(grade_answer(states["action_text"].strip(), states["label"]))
        return {"rewards": reward, "scores": reward, "environment_feedback": "", "done": True}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


def sized(argv: list[str]) -> list[str]:
    """``argv`` with every size flag's value(s) replaced by ``SIZES``'."""
    argv = list(argv)
    for i, token in enumerate(argv[:-1]):
        if token in SIZES:
            argv[i + 1] = SIZES[token]
    return argv


def tidal_entry(script: Script, function: str = "main"):
    module, name = TIDAL_PARSERS.get(script.module, (script.module.replace("openrlhf.", "tidal.", 1), None))
    return getattr(importlib.import_module(module), function if function == "main" else name or function)


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _chat(*turns: str) -> list[dict]:
    return [{"role": role, "content": text} for role, text in zip(("user", "assistant"), turns, strict=False)]


def _prm_model(policy: Path, path: Path) -> str:
    """The tiny model with Math-Shepherd's step marker ``ки`` as one token of its vocabulary (as in
    Mistral's, the script's model; tidal refuses a marker that is several tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy)
    tokenizer.add_tokens(["ки"])
    model = AutoModelForCausalLM.from_pretrained(policy)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _image_rows(folder: Path) -> str:
    """geometry3k's shape (``prompt``, ``label``, ``images``) from tidal's colour task."""
    from tidal.testing import ColourTask

    rows = ColourTask(seed=2).rows(folder, 4)
    return _jsonl(folder / "prompts.jsonl", [{**row, "label": row.pop("answer")} for row in rows])


@pytest.fixture(scope="module")
def paths(tiny_llama, reward_model, tmp_path_factory) -> dict[str, str]:
    """The scripts' path placeholders → tiny local models and data files in the row formats they expect."""
    from tidal.testing import build_tiny_model, build_tiny_vlm

    root = tmp_path_factory.mktemp("openrlhf_examples")
    (root / "reward_func.py").write_text(REWARD_FN)
    (root / "math_reward_func.py").write_text(MATH_FN)
    (root / "agent_func.py").write_text(AGENT_FN)
    (root / "images").mkdir()
    return {
        "policy": str(tiny_llama), "teacher": str(tiny_llama), "reward": str(reward_model),
        "prm_model": _prm_model(tiny_llama, root / "prm_model"),
        "moe": str(build_tiny_model(root / "mixtral", "mixtral", seed=0)),
        "vlm": str(build_tiny_vlm(root / "vlm", "qwen3_5")),  # the v0.11.0 VLM script's family (Qwen3.5-2B)
        "sft": _jsonl(root / "orca.jsonl", [{"question": q, "response": str(eval(q[:-1]))} for q in QUESTIONS]),
        "prefs": _jsonl(root / "prefs.jsonl", [{"chosen": _chat(q, "2"), "rejected": _chat(q, "7")} for q in QUESTIONS]),
        "kto": _jsonl(root / "kto.jsonl", [{"instruction": q, "response": r, "score": r == "2"}
                                           for q in QUESTIONS for r in ("2", "7")]),
        "prm": _jsonl(root / "shepherd.jsonl", [{"input": f"{q} Step 1: 1 ки Step 2: 2 ки", "value": ["+", "-"]}
                                                for q in QUESTIONS]),
        "prompts": _jsonl(root / "prompts.jsonl", [{"context_messages": _chat(q)} for q in QUESTIONS]),
        "math": _jsonl(root / "math.jsonl", [{"prompt": _chat(f"{q} Answer in \\boxed{{}}."),
                                              "label": str(eval(q[:-1]))} for q in QUESTIONS]),
        "images": _image_rows(root / "images"),
        "reward_fn": str(root / "reward_func.py"), "math_fn": str(root / "math_reward_func.py"),
        "agent_fn": str(root / "agent_func.py"), "wandb": "offline", "out": str(root / "out"),
    }  # fmt: skip


# Not a v0.9.2 flag: OpenRLHF v0.9.2's own argparse stops there too ("unrecognized arguments").
UNKNOWN = {
    "v0.9.2/train_dapo_ray_hybrid_engine.sh": "unrecognized arguments: --vllm_enable_is_correction "
    "(did you mean --enable_vllm_is_correction?)",
}


def refused_in(script: Script) -> list[str]:
    """The script's flags that tidal refuses (``tidal.cli.openrlhf``'s table, docs/openrlhf.md)."""
    from tidal.cli.openrlhf import refusals

    table = refusals(script.module.rsplit(".", 1)[1])
    return [token for token in script.flags.split() if token[2:] in table]


# v0.11.0's async agent script asks for partial rollouts, which tidal runs for single-turn rollouts on
# the trainer's device only: refused in one line per reason when the run is checked.
CHECK_REFUSED = {"v0.11.0/train_reinforce_baseline_ray_agent_async.sh": "--partial_rollout_enable needs "}


def test_the_refused_scripts_are_the_documented_ones():
    refused = {script.name for script in SCRIPTS if refused_in(script)}
    assert refused <= set(CHECK_REFUSED)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.name)
def test_every_script_builds_its_run(script, paths, capsys):
    """The run builds, or tidal stops in one line per refused flag, each naming it (exit status 2)."""
    parse = tidal_entry(script, "parse_run")
    argv = sized(script.argv(paths))
    expected = (
        [UNKNOWN[script.name]]
        if script.name in UNKNOWN
        else [f"{flag} is not supported: " for flag in refused_in(script)]
    )
    if script.name in CHECK_REFUSED and not expected:
        from tidal.config.args import ConfigError

        with pytest.raises(ConfigError) as err:
            parse(argv)
        assert all(line.startswith(CHECK_REFUSED[script.name]) for line in str(err.value).splitlines())
        return
    if expected:
        with pytest.raises(SystemExit) as info:
            parse(argv)
        errors = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
        assert info.value.code == 2 and len(errors) == len(expected), errors
        assert all(want in line for want, line in zip(expected, errors, strict=True)), errors
        return
    run = parse(argv)
    assert run is not None


SCRIPT = {script.name: script for script in SCRIPTS}


@pytest.mark.parametrize(
    "name, model",
    [
        ("v0.9.2/train_sft.sh", "policy"),
        ("v0.11.0/train_dpo_llama.sh", "policy"),
        ("v0.11.0/train_dapo_ray_hybrid_engine.sh", "policy"),  # GRPO, dynamic filtering, reward_func.py
        ("v0.11.0/train_vlm_math_hybrid_engine.sh", "vlm"),  # images, --actor.freeze_visual_encoder
    ],
)
def test_a_script_trains_one_tiny_step(name, model, paths, tmp_path):
    """The script's command, its launcher replaced by one call of the tidal module's ``main``, trains one
    step at these sizes (4 samples or one rollout of 4 prompts) and saves the model. (The step moves no
    weight in SFT/DPO: the scripts' warmup starts the learning rate at 0, as in OpenRLHF.)"""
    out = tmp_path / "out"
    history = tidal_entry(SCRIPT[name])(sized(SCRIPT[name].argv({**paths, "out": str(out)})))
    assert len(history) == 1, history
    assert (out / "final" / "model.safetensors").exists() and (out / "final" / "config.json").exists()


def test_is_correction_type_picks_tidals_correction(capsys):
    """v0.11.0's ``--algo.advantage.is_correction_type`` (v0.10's ``--vllm_is_correction_type``): ``tis`` is
    what ``--enable_vllm_is_correction`` does, ``icepop`` is ``--use_icepop``; ``seq-mask-tis`` is refused."""
    from tidal.cli.train_ppo import parse_run

    base = [
        "--pretrain",
        "m",
        "--prompt_data",
        "d",
        "--remote_rm_url",
        "r.py",
        "--algo.advantage.is_correction_enable",
    ]
    for value, icepop in [("tis", False), ("icepop", True)]:
        algorithm = parse_run([*base, "--algo.advantage.is_correction_type", value]).algorithm
        assert (algorithm.enable_vllm_is_correction, algorithm.use_icepop) == (True, icepop)
    assert parse_run([*base, "--vllm_is_correction_type=icepop"]).algorithm.use_icepop
    for value, message in [
        ("seq-mask-tis", "--vllm_is_correction_type seq-mask-tis is not supported: a sequence-level"),
        ("tsi", "--vllm_is_correction_type takes one of tis, icepop, seq-mask-tis, got 'tsi'"),
    ]:
        with pytest.raises(SystemExit):
            parse_run([*base, "--algo.advantage.is_correction_type", value])
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"tidal ppo: error: {message}"), line
