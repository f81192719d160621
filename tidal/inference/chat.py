"""Interactive multi-turn chat (``tidal chat``) on tidal's rollout engine.

A ``ChatSession`` keeps the conversation and renders it before every turn:

- with a chat template (``--apply_chat_template auto`` and the tokenizer has one, or ``true``): the
  message list (optional ``--system_prompt`` first) through the template with the generation prompt;
- without one: plain text, each user turn formatted with ``--input_template`` (default
  ``"User: {}\\nAssistant: "``) and followed by the model's reply, as OpenRLHF's interactive chat.

``--ta_prompt FILE`` (plain text only, as OpenRLHF) opens the conversation with the file's text, and
``--enable_csft`` ends every prompt with ``--csft_prompt`` (conditional SFT), in both renderings.

When the rendered history leaves no room for ``--max_new_tokens``, the oldest turns are dropped
(the system prompt stays). ``run_chat`` reads the user's lines from a text stream, so the session
can be driven by a terminal or a pipe; ``/reset`` clears the history, ``/exit`` (or end of input)
ends the session.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from tidal.config.args import ConfigError, arg
from tidal.inference.config import DEFAULT_CSFT_PROMPT, csft_prompt_suffix

if TYPE_CHECKING:  # ChatConfig builds tidal chat's --help: torch and datasets load when a chat starts
    from tidal.rollout import LLMEngine, SamplingParams

DEFAULT_INPUT_TEMPLATE = "User: {}\nAssistant: "
RESET, EXIT = "/reset", "/exit"


@dataclass
class ChatConfig:
    """Conversation: how turns are rendered."""

    apply_chat_template: str = arg(
        "auto",
        help="render the conversation with the tokenizer's chat template: auto (when it has one), true, false",
        choices=("auto", "true", "false"),
        nargs="?",
        const="true",
    )
    input_template: str = arg(
        DEFAULT_INPUT_TEMPLATE, help="without a chat template: how a user turn is written ('{}' is the text)"
    )
    system_prompt: str | None = arg(None, help="system message that opens the conversation")
    ta_prompt: str | None = arg(
        None,
        help="text file whose content opens a plain-text conversation (OpenRLHF's assistant preamble; "
        "not with a chat template: use --system_prompt there)",
        metavar="FILE",
    )
    load_in_4bit: bool = arg(
        False,
        help="load the model's linear layers in 4-bit NF4 (bitsandbytes) and reply through "
        "transformers.generate (tidal's engine has no 4-bit kernels; slower, for models that only fit in 4 bits)",
    )
    enable_csft: bool = arg(False, help="conditional SFT: end every prompt with --csft_prompt")
    csft_prompt: str = arg(
        DEFAULT_CSFT_PROMPT, help="--enable_csft: appended to each prompt (stripped, then one space)"
    )

    def use_template(self, tokenizer) -> bool:
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if self.apply_chat_template == "true" and not has_template:
            raise ConfigError("--apply_chat_template true: the tokenizer has no chat template")
        use = has_template if self.apply_chat_template == "auto" else self.apply_chat_template == "true"
        if use and self.ta_prompt is not None:
            raise ConfigError(
                "--ta_prompt opens a plain-text conversation and the chat template is on: use "
                "--system_prompt with a chat template, or --apply_chat_template false"
            )
        return use

    def preamble(self) -> str:
        """The text that opens a plain-text conversation: ``--system_prompt``, then ``--ta_prompt``'s file."""
        parts = [self.system_prompt + "\n"] if self.system_prompt else []
        if self.ta_prompt is not None:
            try:
                parts.append(Path(self.ta_prompt).read_text(encoding="utf-8") + "\n")
            except (OSError, UnicodeDecodeError) as err:
                raise ConfigError(f"--ta_prompt {self.ta_prompt}: cannot read it as text ({err})") from err
        return "".join(parts)

    def validate(self) -> None:
        from tidal.data.templates import check_input_template  # tidal.data imports datasets

        try:
            check_input_template(self.input_template)
        except ValueError as err:
            raise ConfigError(str(err)) from err
        if self.csft_prompt != DEFAULT_CSFT_PROMPT and not self.enable_csft:
            raise ConfigError("--csft_prompt is appended to the prompts by --enable_csft: pass it too")
        if self.ta_prompt is not None:
            self.preamble()  # an unreadable file fails before the model loads


class ChatSession:
    """One conversation with the engine's model: ``reply(text)`` runs a turn, ``reset()`` forgets."""

    def __init__(self, engine: LLMEngine, params: SamplingParams, cfg: ChatConfig, model: str = "the model"):
        self.engine, self.params, self.cfg, self.model = engine, params, cfg, model
        self.tokenizer = engine.tokenizer
        self.use_template = cfg.use_template(self.tokenizer)
        self.preamble = "" if self.use_template else cfg.preamble()
        self.suffix = csft_prompt_suffix(cfg.csft_prompt) if cfg.enable_csft else ""
        self.turns: list[tuple[str, str]] = []  # (user, assistant) pairs, oldest first
        self.dropped = 0  # turns forgotten because the history outgrew the context

    def reset(self) -> None:
        self.turns, self.dropped = [], 0

    def reply(self, text: str) -> str:
        ids = self._fit(text)
        from tidal.inference.generate import check_finite_samples  # here: --help imports this module

        result = self.engine.generate([ids], self.params)
        check_finite_samples(result, self.model)  # NaN weights: stop, rather than answer "" forever
        out = result[0].outputs[0]
        answer = out.text.strip() if self.use_template else out.text
        self.turns.append((text, answer))
        return answer

    def render(self, text: str) -> str:
        """The prompt for the next reply: the history, then ``text`` as the newest user turn."""
        if self.use_template:
            messages = (
                [{"role": "system", "content": self.cfg.system_prompt}] if self.cfg.system_prompt else []
            )
            for user, assistant in self.turns:
                messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
            messages.append({"role": "user", "content": text})
            rendered = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            return rendered + self.suffix
        parts = [self.preamble]
        for user, assistant in self.turns:
            parts += [self.cfg.input_template.format(user), assistant, "\n"]
        parts += [self.cfg.input_template.format(text), self.suffix]
        return "".join(parts)

    def _fit(self, text: str) -> list[int]:
        """Token ids of the prompt, dropping the oldest turns until the reply fits the context."""
        from tidal.data.templates import tokenize_texts

        budget = self.engine.max_model_len - self.params.max_new_tokens
        while True:
            ids = tokenize_texts(self.tokenizer, [self.render(text)], self.use_template)["input_ids"][0]
            if len(ids) <= budget or not self.turns:
                break
            self.turns.pop(0)
            self.dropped += 1
        if len(ids) > budget:
            raise ConfigError(
                f"the message is {len(ids)} tokens but only {budget} fit before --max_new_tokens "
                f"{self.params.max_new_tokens} in the model's {self.engine.max_model_len}-token context"
            )
        return list(ids)


def run_chat(session: ChatSession, stdin: TextIO, stdout: TextIO, interactive: bool = False) -> int:
    """Read user lines until ``/exit`` or end of input; return the number of replies."""
    replies = 0
    if interactive:
        stdout.write(f"chat with the model ({RESET}: forget the conversation, {EXIT}: quit)\n")
    while True:
        if interactive:
            stdout.write("You: ")
            stdout.flush()
        line = stdin.readline()
        if not line:  # end of input
            break
        text = line.strip()
        if text == EXIT:
            break
        if text == RESET:
            session.reset()
            stdout.write("(conversation reset)\n")
        elif text:
            replies += _turn(session, text, stdout)
        stdout.flush()
    return replies


def _turn(session: ChatSession, text: str, stdout: TextIO) -> int:
    before = session.dropped
    try:
        answer = session.reply(text)
    except ConfigError as err:  # one over-long message should not end the conversation
        stdout.write(f"({err})\n")
        return 0
    if session.dropped > before:
        stdout.write(f"(dropped the {session.dropped - before} oldest turn(s) to fit the context)\n")
    stdout.write(f"Assistant: {answer}\n")
    return 1
