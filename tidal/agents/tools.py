"""``ToolAgentExecutor``: a multi-turn agent that calls Python functions as tools, token in, token out.

    def multiply(a: int, b: int) -> int:
        \"\"\"Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        \"\"\"
        return a * b

    class AgentExecutor(ToolAgentExecutor):          # in an --agent_func_path file
        def __init__(self):
            super().__init__(tools=[multiply], reward_fn=exact_match, parser="hermes", max_turns=3)

Each episode, on ``MultiTurnAgentExecutor``'s loop (so only the model's tokens are trained and
nothing is re-tokenized):

1. the prompt becomes a chat: an optional system message and the prompt as the user message,
   rendered by the tokenizer's chat template with ``tools=`` the functions' JSON schemas (derived from
   signatures and docstrings by ``transformers.utils.get_json_schema``). A template that does not
   render tools gets them in a system message in the parser's format (``tools_in_prompt=False``
   leaves them out). Prompts already rendered by ``--apply_chat_template`` are used as they are.
2. the model's message is parsed (``tidal.data.tool_parsers``); with tool calls, each function runs
   with the call's arguments and the results come back as ``role: "tool"`` messages rendered by the
   chat template — only the text the template adds after the assistant's message, so the tokens the
   model generated stay exactly as sampled — followed by the next assistant header;
3. a message without tool calls is the final answer: ``reward_fn(answer, label)`` is the episode's
   score, and its reward plus ``tool_call_reward`` when the episode's tool calls ran before it (a
   format reward that gets a small model to use the tools; 0, the default, leaves the reward as
   ``reward_fn``'s). After ``max_turns`` messages that all called tools the episode ends with 0.

A call that does not parse (``agent/tool_parse_errors``), an unknown tool (``agent/unknown_tool_errors``),
arguments that do not fit the function or a tool that raises (``agent/tool_errors``) end the episode
with reward 0, a warning and a count in the step's logs; ``reward_fn`` raising counts as
``agent/agent_errors``. Per-episode logs: ``agent/tool_calls`` and ``agent/turns`` (means).
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tidal.agents.base import AgentError, AgentInstanceBase, EpisodeError, describe
from tidal.agents.multi_turn import MultiTurnAgentExecutor
from tidal.data.tool_parsers import (
    TOOL_PARSERS,
    ToolParseError,
    detect_tool_parser,
    parse_tool_calls,
)

# Marks where the assistant's message ends in a rendered chat (ASCII, no spaces: templates may strip).
_MARKER = "TIDAL_ASSISTANT_MESSAGE_END_4f1c"


def tool_schema(fn: Callable) -> dict:
    """The OpenAI tool schema of a Python function, from its signature and Google-style docstring."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as err:  # transformers says which argument lacks a type hint or description
        raise AgentError(f"tool {describe_fn(fn)}: no JSON schema ({err})") from err


def describe_fn(fn: Callable) -> str:
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        return f"{name} ({inspect.getsourcefile(fn)})"
    except TypeError:
        return name


def tools_system_prompt(schemas: Sequence[dict], parser: str) -> str:
    """A system message that lists the tools and the call format, for templates that render no tools
    (the wording of Qwen2.5's template for ``hermes``, of Llama 3.1's for ``llama3_json``)."""
    listed = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    if parser == "llama3_json":
        return (
            "Given the following functions, please respond with a JSON for a function call with its proper "
            "arguments that best answers the given prompt.\n\nRespond in the format "
            '{"name": function name, "parameters": dictionary of argument name and its value}. '
            f"Do not use variables.\n\n{listed}"
        )
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n"
        "</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call>"
    )


def tool_result_text(value: Any) -> str:
    """A tool's return value as the tool message's content: strings as they are, the rest as JSON."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except TypeError:
        return str(value)


def render_tool_turn(tokenizer, tool_messages: list[dict], action_ids: Sequence[int]) -> str:
    """The text the chat template puts after an assistant message: the tool messages and the next
    assistant header. The end-of-turn token the model already generated is not repeated; when the
    model did not end its turn (a length cut), the template's end of turn stays in."""
    chat = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARKER}, *tool_messages]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    after = text[text.index(_MARKER) + len(_MARKER) :]
    if action_ids and action_ids[-1] in set(tokenizer.all_special_ids):
        end = tokenizer.decode([action_ids[-1]], skip_special_tokens=False)
        if after.startswith(end):
            after = after[len(end) :]
    return after


def renders_tools(chat_template: str | dict | None) -> bool:
    """Whether the chat template reads the ``tools`` variable (else ``tools=`` would be ignored)."""
    if isinstance(chat_template, dict):
        chat_template = "\n".join(str(t) for t in chat_template.values())
    return bool(chat_template) and "tools" in chat_template


@dataclass(frozen=True)
class ToolSpec:
    """What every episode of a ``ToolAgentExecutor`` shares."""

    tools: dict[str, Callable]
    schemas: list[dict]
    reward_fn: Callable[[str, Any], float]
    max_turns: int
    system_prompt: str | None
    tools_in_prompt: bool
    tool_call_reward: float = 0.0


class ToolEnv(AgentInstanceBase):
    """One tool-using episode (see the module doc); created by ``ToolAgentExecutor`` per sample."""

    def __init__(self, spec: ToolSpec, tokenizer, parser: str, render_prompt: bool):
        self.spec, self.tokenizer, self.parser, self.render_prompt = spec, tokenizer, parser, render_prompt
        self.turn = 0
        self.calls = 0

    async def reset(self, states: dict, **kwargs) -> dict:
        if not self.render_prompt:  # already rendered by --apply_chat_template
            return {"observation": states["observation"]}
        return {"observation": self.render_prompt_text(states["observation"])}

    def render_prompt_text(self, prompt: str) -> str:
        spec, template = self.spec, self.tokenizer.chat_template
        system = [spec.system_prompt] if spec.system_prompt else []
        tools = spec.schemas if spec.tools_in_prompt and renders_tools(template) else None
        if spec.tools_in_prompt and tools is None:
            system.append(tools_system_prompt(spec.schemas, self.parser))
        messages = [{"role": "system", "content": "\n\n".join(system)}] if system else []
        messages.append({"role": "user", "content": prompt})
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )

    async def step(self, states: dict, **kwargs) -> dict:
        self.turn += 1
        try:
            parsed = parse_tool_calls(states["action_text"], self.parser)
        except ToolParseError as err:
            raise EpisodeError(
                f"turn {self.turn}: the model's tool call does not parse: {err}", "tool_parse_errors"
            ) from err
        if not parsed.tool_calls:
            score = self.spec.reward_fn(parsed.content, states["label"])
            # Every call of the episode ran (a failing one would have ended it): the tool-use bonus.
            bonus = self.spec.tool_call_reward if self.calls else 0.0
            return self.answer(score + bonus if bonus else score, score)
        if self.turn >= self.spec.max_turns:  # still calling tools with no turn left: no answer
            return self.answer(0.0, 0.0)
        results = [await self.call(c) for c in parsed.tool_calls]
        feedback = render_tool_turn(self.tokenizer, results, states.get("action_token_ids") or [])
        return {"rewards": 0.0, "environment_feedback": feedback, "done": False}

    def answer(self, reward, score) -> dict:
        """The episode's last step."""
        logs = {"agent/tool_calls": float(self.calls), "agent/turns": float(self.turn)}
        return {
            "rewards": reward,
            "scores": score,
            "environment_feedback": "",
            "done": True,
            "extra_logs": logs,
        }

    async def call(self, tool_call: dict) -> dict:
        """Run one call; its result as a ``role: "tool"`` message."""
        self.calls += 1
        name = tool_call["function"]["name"]
        fn = self.spec.tools.get(name)
        if fn is None:
            raise EpisodeError(
                f"turn {self.turn}: the model called an unknown tool {name!r}; tools: {sorted(self.spec.tools)}",
                "unknown_tool_errors",
            )
        arguments = json.loads(tool_call["function"]["arguments"])
        try:
            inspect.signature(fn).bind(**arguments)
        except TypeError as err:
            raise EpisodeError(
                f"turn {self.turn}: bad arguments for tool {name}: {err}", "tool_errors"
            ) from err
        try:
            value = fn(**arguments)
            if inspect.isawaitable(value):
                value = await value
        except Exception as err:
            raise EpisodeError(
                f"turn {self.turn}: tool {name}({_args(arguments)}) raised {type(err).__name__}: {err}",
                "tool_errors",
            ) from err
        return {
            "role": "tool",
            "tool_call_id": tool_call["id"],
            "name": name,
            "content": tool_result_text(value),
        }


class ToolAgentExecutor(MultiTurnAgentExecutor):
    """Episodes in which the model may call ``tools`` (Python functions) before answering.

    ``parser``: a name in ``TOOL_PARSERS`` or "auto" (read from the tokenizer's chat template).
    ``reward_fn(answer, label) -> float``: the reward of the final answer (the message without calls).
    ``system_prompt``: extra system text; ``tools_in_prompt``: list the tools in the prompt.
    ``tool_call_reward``: added to the reward (not the score) of an episode that answered after tool
    calls that all ran; it rewards using the tools whether or not the answer is right, so keep it below
    a right answer's reward."""

    def __init__(
        self,
        tools: Sequence[Callable],
        reward_fn: Callable[[str, Any], float],
        parser: str = "auto",
        max_turns: int = 4,
        system_prompt: str | None = None,
        tools_in_prompt: bool = True,
        tool_call_reward: float = 0.0,
    ):
        if parser != "auto" and parser not in TOOL_PARSERS:
            raise AgentError(
                f"ToolAgentExecutor: unknown parser {parser!r}; expected 'auto' or one of {sorted(TOOL_PARSERS)}"
            )
        if max_turns < 1:
            raise AgentError(f"ToolAgentExecutor: max_turns must be >= 1, got {max_turns}")
        named = {getattr(fn, "__name__", None): fn for fn in tools}
        if None in named or len(named) != len(tools):
            raise AgentError(
                f"ToolAgentExecutor: tools must be named functions with distinct names, got {list(tools)}"
            )
        if not callable(reward_fn):
            raise AgentError(f"ToolAgentExecutor: reward_fn must be callable, got {reward_fn!r}")
        if not isinstance(tool_call_reward, (int, float)) or not math.isfinite(tool_call_reward):
            raise AgentError(
                f"ToolAgentExecutor: tool_call_reward must be a finite number, got {tool_call_reward!r}"
            )
        spec = ToolSpec(
            named,
            [tool_schema(fn) for fn in tools],
            reward_fn,
            max_turns,
            system_prompt,
            tools_in_prompt,
            float(tool_call_reward),
        )
        super().__init__(ToolEnv, {"spec": spec})
        self.spec, self.parser = spec, parser

    def instance_kwargs_for(self, tokenizer) -> dict:
        # Prompts not rendered by --apply_chat_template (add_special_tokens still True) are rendered here.
        return {**self.instance_kwargs, "tokenizer": tokenizer, "parser": self.resolve_parser(tokenizer),
                "render_prompt": self.add_special_tokens}  # fmt: skip

    def resolve_parser(self, tokenizer) -> str:
        # Checked here, not in the episode: without a template every episode would fail the same way.
        if not getattr(tokenizer, "chat_template", None):
            raise AgentError(
                f"{describe(self)}: the tokenizer has no chat template, which renders the chat and the tool "
                "messages; set one (e.g. --tokenizer_chat_template)"
            )
        if self.parser != "auto":
            return self.parser
        found = detect_tool_parser(getattr(tokenizer, "chat_template", None))
        if found is None:
            raise AgentError(
                f"{describe(self)}: parser='auto' but the tokenizer's chat template shows no tool-call format; "
                f"pass parser= one of {sorted(TOOL_PARSERS)}"
            )
        return found

    def encode_prompt(self, tokenizer, text: str) -> list[int]:
        # The chat template already wrote any bos token, here or with --apply_chat_template.
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _args(arguments: dict) -> str:
    text = ", ".join(f"{k}={v!r}" for k, v in arguments.items())
    return text if len(text) <= 120 else text[:120] + "..."
