"""Tool calls: the parsers, ToolAgentExecutor on a scripted model (token in, token out; each kind of
per-episode failure), examples/tool_agent_func.py, and failed episodes counted by a tidal ppo run."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from tidal.agents import (
    AgentError,
    AgentInstanceBase,
    MultiTurnAgentExecutor,
    ToolAgentExecutor,
    ToolParseError,
    detect_tool_parser,
    parse_tool_calls,
    tool_schema,
)
from tidal.agents.base import rollout_logs
from tidal.rollout import SamplingParams
from tidal.rollout.outputs import CompletionOutput, RequestOutput

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


# ---- parsers ---------------------------------------------------------------------------------------
def test_hermes_several_calls_and_content():
    text = (
        'Let me compute. <tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
    )
    parsed = parse_tool_calls(text, "hermes")
    assert parsed.content == "Let me compute."
    assert parsed.tool_calls == [
        {
            "id": "call_0",
            "type": "function",
            "function": {"name": "multiply", "arguments": '{"a": 12, "b": 34}'},
        },
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
    ]
    assert parsed.calls == [("multiply", {"a": 12, "b": 34}), ("add", {"a": 1})]


def test_hermes_no_call_and_unclosed_last_call():
    assert parse_tool_calls(" The answer is 408. ", "hermes").tool_calls == []
    assert parse_tool_calls(" The answer is 408. ", "hermes").content == "The answer is 408."
    # generation stopped at "</tool_call>" used as a stop string: the text ends inside the call
    parsed = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}', "hermes")
    assert parsed.calls == [("f", {})]


@pytest.mark.parametrize(
    "text, message",
    [
        ('<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>', r"tool call 0 is not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', r"tool call 0 has no string 'name'"),
        ('<tool_call>["f"]</tool_call>', r"tool call 0 is a JSON list, not an object"),
        (
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
            r"tool call 0 \(f\): 'arguments' must be an object",
        ),
        (
            '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": </tool_call>',
            r"tool call 1 is not valid JSON",
        ),
    ],
)
def test_hermes_malformed_calls_are_explained(text, message):
    with pytest.raises(ToolParseError, match=message):
        parse_tool_calls(text, "hermes")


def test_llama3_json_calls():
    parsed = parse_tool_calls('{"name": "multiply", "parameters": {"a": 2, "b": 3}}', "llama3_json")
    assert parsed.content == "" and parsed.calls == [("multiply", {"a": 2, "b": 3})]
    tagged = parse_tool_calls(
        '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"x": 1}}', "llama3_json"
    )
    assert tagged.calls == [("f", {}), ("g", {"x": 1})]
    assert [c["id"] for c in tagged.tool_calls] == ["call_0", "call_1"]
    assert parse_tool_calls("The answer is 6.", "llama3_json").tool_calls == []
    assert parse_tool_calls('{"answer": 6}', "llama3_json").tool_calls == []  # JSON but no call


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"name": "f", "parameters": {"a": 1}', r"tool call 0 is not valid JSON"),
        ('<|python_tag|>{"parameters": {}}', r"tool call 0 has no string 'name'"),
        ('{"name": "f", "parameters": {}} and then text', r"text after tool call 0 \(expected ';'"),
        ("<|python_tag|>", r"followed by no tool call"),
    ],
)
def test_llama3_json_malformed_calls_are_explained(text, message):
    with pytest.raises(ToolParseError, match=message):
        parse_tool_calls(text, "llama3_json")


def test_unknown_parser_and_detection():
    with pytest.raises(
        ValueError, match=r"unknown tool parser 'nope'; expected one of \['hermes', 'llama3_json'\]"
    ):
        parse_tool_calls("x", "nope")
    qwen = "{%- if tools %}...<tools>{{ tool | tojson }}</tools>...<tool_call>\\n{{ tool_call | tojson }}</tool_call>"
    llama = '<|start_header_id|>ipython<|end_header_id|>{"name": ..., "parameters": ...}<|python_tag|>'
    assert detect_tool_parser(qwen) == "hermes"
    assert detect_tool_parser({"default": "x", "tool_use": qwen}) == "hermes"
    assert detect_tool_parser(llama) == "llama3_json"
    assert detect_tool_parser("{{ messages }}") is None and detect_tool_parser(None) is None


# ---- the executor on a scripted model --------------------------------------------------------------
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def divide(a: int, b: int) -> float:
    """Divide.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def exact(answer: str, label) -> float:
    return float(answer.strip() == str(label))


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class ScriptedEngine:
    """Answers each prompt with the next scripted message of its question (by assistant turns so far),
    ending it with eos; every sampled token gets log-prob -0.5."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]]):
        self.tok, self.scripts, self.calls = tokenizer, scripts, []
        self.tokenizer = None  # the executor decodes

    def generate(self, prompts, params):
        outs = []
        for i, ids in enumerate(prompts):
            text = self.tok.decode(ids, skip_special_tokens=False)
            question = next(q for q in self.scripts if f"user\n{q}<|im_end|>" in text)
            turn = text.count("<|im_start|>assistant") - 1
            reply = self.tok(self.scripts[question][turn], add_special_tokens=False)["input_ids"]
            reply.append(self.tok.eos_token_id)
            outs.append(
                RequestOutput(i, None, ids, [CompletionOutput(0, "", reply, [-0.5] * len(reply), "stop")])
            )
            self.calls.append(text)
        return outs


@pytest.fixture(scope="module")
def qwen_tok(tiny_qwen2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_qwen2))


def run(executor, tokenizer, scripts, labels, max_length=400):
    engine = ScriptedEngine(tokenizer, scripts)
    params = SamplingParams(max_new_tokens=80)
    return executor.run(engine, tokenizer, list(scripts), labels, params, max_length=max_length), engine


def test_tool_episode_token_in_token_out(qwen_tok):
    executor = ToolAgentExecutor([multiply], exact, parser="hermes", tools_in_prompt=False)
    scripts = {"12*34=": [call("multiply", a=12, b=34), "408"]}
    [traj], engine = run(executor, qwen_tok, scripts, ["408"])
    assert (traj.reward, traj.finish_reason, traj.num_turns, traj.error) == (1.0, "done", 2, None)
    assert traj.extra_logs == {"agent/tool_calls": 1.0, "agent/turns": 2.0}
    # The context the model saw on turn 2 is the chat template's rendering of the whole conversation.
    conversation = [
        {"role": "user", "content": "12*34="},
        {"role": "assistant", "content": call("multiply", a=12, b=34)},
        {"role": "tool", "content": "408"},
    ]
    assert engine.calls[1] == qwen_tok.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )
    # Only the sampled tokens are actions; the tool message and assistant header are observations.
    tok = lambda s: qwen_tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = [qwen_tok.eos_token_id]
    action1, feedback, action2 = (
        tok(call("multiply", a=12, b=34)) + eos,
        tok("\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"),
        tok("408") + eos,
    )
    prompt = tok("<|im_start|>user\n12*34=<|im_end|>\n<|im_start|>assistant\n")
    assert traj.token_ids == prompt + action1 + feedback + action2
    assert traj.action_mask == [0] * len(prompt) + [1] * len(action1) + [0] * len(feedback) + [1] * len(
        action2
    )
    assert traj.rollout_logprobs == [0.0] * len(prompt) + [-0.5] * len(action1) + [0.0] * len(feedback) + [
        -0.5
    ] * len(action2)


def test_tools_are_listed_in_the_prompt(qwen_tok):
    executor = ToolAgentExecutor([multiply], exact, parser="hermes", max_turns=1)
    [traj], engine = run(executor, qwen_tok, {"2*3=": ["6"]}, ["6"], max_length=1000)
    # the tiny template renders no tools, so a system message lists them in the hermes format
    assert '<tools>\n{"type": "function", "function": {"name": "multiply"' in engine.calls[0]
    assert traj.reward == 1.0 and traj.extra_logs == {"agent/tool_calls": 0.0, "agent/turns": 1.0}


def test_auto_parser_needs_a_template_that_shows_tool_calls(qwen_tok):
    executor = ToolAgentExecutor([multiply], exact)
    with pytest.raises(
        AgentError, match=r"parser='auto' but the tokenizer's chat template shows no tool-call"
    ):
        run(executor, qwen_tok, {"2*3=": ["6"]}, ["6"])


def test_a_tokenizer_without_chat_template_is_refused(qwen_tok):
    import copy

    plain = copy.deepcopy(qwen_tok)
    plain.chat_template = None
    executor = ToolAgentExecutor([multiply], exact, parser="hermes")
    with pytest.raises(AgentError, match=r"the tokenizer has no chat template"):
        run(executor, plain, {"2*3=": ["6"]}, ["6"])


def test_tool_call_reward_goes_to_answers_after_calls_that_ran(qwen_tok):
    executor = ToolAgentExecutor(
        [multiply, divide], exact, parser="hermes", max_turns=2, tools_in_prompt=False, tool_call_reward=0.25
    )
    scripts = {
        "2*3=": [call("multiply", a=2, b=3), "6"],  # called, right
        "4*5=": [call("multiply", a=4, b=5), "21"],  # called, wrong: the bonus alone
        "6*7=": ["42"],  # right without the tool: no bonus
        "1/0=": [call("divide", a=1, b=0)],  # the call raised: the episode failed, no bonus
        "8*9=": [call("multiply", a=8, b=9), call("multiply", a=8, b=9)],  # no answer within max_turns
    }
    trajs, _ = run(executor, qwen_tok, scripts, ["6", "20", "42", "0", "72"])
    assert [t.reward for t in trajs] == [1.25, 0.25, 1.0, 0.0, 0.0]
    assert [t.score for t in trajs] == [1.0, 0.0, 1.0, 0.0, 0.0]  # the bonus is not in the score
    assert trajs[3].error_kind == "tool_errors"
    with pytest.raises(AgentError, match=r"tool_call_reward must be a finite number, got nan"):
        ToolAgentExecutor([multiply], exact, parser="hermes", tool_call_reward=float("nan"))


def test_max_turns_without_an_answer_scores_zero(qwen_tok):
    executor = ToolAgentExecutor([multiply], exact, parser="hermes", max_turns=2, tools_in_prompt=False)
    [traj], _ = run(executor, qwen_tok, {"2*3=": [call("multiply", a=2, b=3)] * 2}, ["6"])
    assert (traj.reward, traj.num_turns, traj.finish_reason, traj.error) == (0.0, 2, "done", None)


def boom_reward(answer, label):
    if label == "6":
        raise RuntimeError("reward service down")
    return exact(answer, label)


@pytest.mark.parametrize(
    "reply, kind, message",
    [
        (
            '<tool_call>{"name": "multiply", "arguments": {"a": 2,}}</tool_call>',
            "tool_parse_errors",
            r"turn 1: the model's tool call does not parse: tool call 0 is not valid JSON",
        ),
        (
            call("add", a=2, b=3),
            "unknown_tool_errors",
            r"turn 1: the model called an unknown tool 'add'; tools: \['divide', 'multiply'\]",
        ),
        (
            call("divide", a=2, b=0),
            "tool_errors",
            r"turn 1: tool divide\(a=2, b=0\) raised ZeroDivisionError",
        ),
        (call("multiply", a=2, c=3), "tool_errors", r"turn 1: bad arguments for tool multiply"),
        ("6", "agent_errors", r"ToolEnv \(.*tools.py\)\.step raised RuntimeError: reward service down"),
    ],
)
def test_each_failure_ends_its_episode_only(qwen_tok, caplog, reply, kind, message):
    reward_fn = boom_reward if kind == "agent_errors" else exact
    executor = ToolAgentExecutor([multiply, divide], reward_fn, parser="hermes", tools_in_prompt=False)
    scripts = {"2*3=": [reply], "4*5=": [call("multiply", a=4, b=5), "20"]}
    with caplog.at_level(logging.WARNING, logger="tidal.agents.base"):
        (bad, good), _ = run(executor, qwen_tok, scripts, ["6", "20"])
    assert (bad.reward, bad.score, bad.finish_reason, bad.error_kind) == (0.0, 0.0, "error", kind)
    assert re.search(message, bad.error) and "(prompt 0, sample 0 of 1)" in bad.error
    assert sum(bad.action_mask) > 0  # the failed action stays, trained with reward 0
    assert good.reward == 1.0 and good.error is None  # the other episode goes on
    [record] = [r for r in caplog.records if kind in r.getMessage()]
    assert "1 of 2 episodes failed" in record.getMessage()
    logs = rollout_logs([bad, good])
    assert logs["agent/errors"] == 1.0 and logs[f"agent/{kind}"] == 1.0


def test_an_agent_raising_in_reset_fails_its_episode(qwen_tok):
    class Broken(AgentInstanceBase):
        async def reset(self, states, **kwargs):
            raise OSError("no sandbox")

    [traj] = MultiTurnAgentExecutor(Broken).run(
        ScriptedEngine(qwen_tok, {}), qwen_tok, ["1+1="], ["2"], SamplingParams(), max_length=50
    )
    assert (traj.reward, traj.error_kind, sum(traj.action_mask)) == (0.0, "agent_errors", 0)
    assert "Broken" in traj.error and "reset raised OSError: no sandbox" in traj.error
    assert traj.token_ids == qwen_tok("1+1=")["input_ids"]


def test_non_finite_rewards_still_stop_the_run(qwen_tok):
    executor = ToolAgentExecutor(
        [multiply], lambda a, label: float("nan"), parser="hermes", tools_in_prompt=False
    )
    with pytest.raises(AgentError, match=r"reward"):
        run(executor, qwen_tok, {"2*3=": ["6"]}, ["6"])


def test_bad_tools_are_explained():
    def undocumented(a: int) -> int:
        return a

    with pytest.raises(AgentError, match=r"tool .*undocumented .*no JSON schema .*no docstring"):
        ToolAgentExecutor([undocumented], exact, parser="hermes")
    with pytest.raises(AgentError, match=r"unknown parser 'xml'"):
        ToolAgentExecutor([multiply], exact, parser="xml")
    assert tool_schema(multiply)["function"]["parameters"]["required"] == ["a", "b"]


# ---- the example and the RL loop -------------------------------------------------------------------
def test_example_agent_file(qwen_tok, tmp_path):
    from tidal.agents import load_agent_executor

    executor = load_agent_executor(EXAMPLES / "tool_agent_func.py")
    assert isinstance(executor, ToolAgentExecutor) and executor.parser == "hermes"
    scripts = {
        "37*58=": ['<tool_call>{"name":"multiply","arguments":{"a":37,"b":58}}</tool_call>', "2146"],
        "12*11=": ["132"],
        "20*30=": [call("multiply", a=20, b=30), "599"],
    }
    trajs, engine = run(executor, qwen_tok, scripts, ["2146", "132", "600"])
    assert [t.score for t in trajs] == [1.0, 1.0, 0.0]
    bonus = executor.spec.tool_call_reward
    assert bonus > 0 and [t.reward for t in trajs] == pytest.approx([1.0 + bonus, 1.0, bonus])
    assert [t.extra_logs["agent/tool_calls"] for t in trajs] == [1.0, 0.0, 1.0]
    assert any("<|im_start|>tool\n2146<|im_end|>\n<|im_start|>assistant\n" in text for text in engine.calls)
    # its data: SFT demonstrations in the chat format the executor renders, and RL prompts with labels
    import importlib.util

    spec = importlib.util.spec_from_file_location("tool_agent_func", EXAMPLES / "tool_agent_func.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    data = example.write_data(tmp_path, n_sft=8, n_prompts=4, tool_fraction=1.0)
    demo = json.loads((data / "sft.jsonl").read_text().splitlines()[0])
    prompt = json.loads((data / "prompts.jsonl").read_text().splitlines()[0])
    a, b = re.search(r"user\n(\d+)\*(\d+)=", demo["prompt"]).groups()
    assert demo["prompt"] == qwen_tok.apply_chat_template(
        [{"role": "user", "content": f"{a}*{b}="}], tokenize=False, add_generation_prompt=True
    )
    assert parse_tool_calls(demo["answer"].split("<|im_end|>")[0], "hermes").calls == [
        ("multiply", {"a": int(a), "b": int(b)})
    ]
    assert demo["answer"].endswith(str(int(a) * int(b)))
    x, y = prompt["prompt"].rstrip("=").split("*")
    assert prompt["label"] == str(int(x) * int(y))


FLAKY_AGENT = '''
from tidal.agents import ToolAgentExecutor


def multiply(a: int, b: int) -> int:
    """Multiply.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def reward(answer, label):
    if label.endswith("0"):
        raise ConnectionError("judge unreachable")
    return 0.5


class AgentExecutor(ToolAgentExecutor):
    def __init__(self):
        super().__init__(tools=[multiply], reward_fn=reward, parser="hermes", max_turns=1, tools_in_prompt=False)
'''


def test_failed_episodes_are_counted_in_the_step_logs_and_training_goes_on(tiny_qwen2, tmp_path, caplog):
    from tidal.cli.train_ppo import parse_run
    from tidal.trainers.ppo import run_ppo

    (tmp_path / "agent.py").write_text(FLAKY_AGENT)
    with (tmp_path / "prompts.jsonl").open("w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"{i}*10=", "label": str(i * 10 + i % 2)}) + "\n")
    with caplog.at_level(logging.WARNING, logger="tidal.agents.base"):
        history = run_ppo(parse_run([
            "--pretrain", str(tiny_qwen2), "--prompt_data", str(tmp_path / "prompts.jsonl"), "--input_key", "prompt",
            "--label_key", "label", "--agent_func_path", str(tmp_path / "agent.py"),
            "--advantage_estimator", "reinforce_baseline", "--n_samples_per_prompt", "2", "--rollout_batch_size", "4",
            "--train_batch_size", "8", "--micro_train_batch_size", "8", "--micro_rollout_batch_size", "8",
            "--generate_max_len", "4", "--prompt_max_len", "16", "--init_kl_coef", "0",
            "--save_path", str(tmp_path / "final"), "--ckpt_path", str(tmp_path / "ckpt"), "--seed", "1",
        ]))  # fmt: skip
    # labels ending in 0 (the 4 even prompts, 8 episodes) fail in reward_fn; the other 8 score 0.5
    assert len(history) == 2 and sum(h["agent/errors"] for h in history) == 8.0
    assert [h["agent/errors"] for h in history] == [h.get("agent/agent_errors", 0.0) for h in history]
    assert sum(h["reward"] for h in history) / 2 == pytest.approx(0.25)
    assert all("policy/loss" in h for h in history)
    warnings = [r.getMessage() for r in caplog.records if "episodes failed (agent_errors)" in r.getMessage()]
    assert len(warnings) == 2 and "step raised ConnectionError: judge unreachable" in warnings[0]


def test_tool_turn_text_does_not_repeat_the_end_of_turn(qwen_tok):
    from tidal.agents.tools import render_tool_turn

    tool = [{"role": "tool", "content": "6"}]
    ended = qwen_tok("x", add_special_tokens=False)["input_ids"] + [qwen_tok.eos_token_id]
    assert (
        render_tool_turn(qwen_tok, tool, ended) == "\n<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n"
    )
    # cut by the length limit: the template's end of turn closes the assistant message
    cut = qwen_tok("x", add_special_tokens=False)["input_ids"]
    assert render_tool_turn(qwen_tok, tool, cut).startswith("<|im_end|>\n<|im_start|>tool\n6")
