"""Math answers: pull the final answer out of a response and grade it against a reference.

``extract_boxed_answer(text)`` returns what the last ``\\boxed{...}`` (or ``\\fbox{...}``) holds, with
nested braces kept whole, or None; ``grade_answer(given, reference)`` says whether two answers are the
same mathematical object: numerically (``0.5`` = ``1/2`` = ``\\frac{1}{2}``, ``1,000`` = ``1000``),
symbolically (``x+1`` = ``1+x``, ``\\sqrt{4}`` = ``2``) or as LaTeX (``\\dfrac{3}{4}`` =
``0.75``). These are the names OpenRLHF's math reward example imports (``from openrlhf.utils import
extract_boxed_answer, grade_answer``, see ``tidal.rewards.openrlhf_compat``), with its meaning: a
missing answer (None) is wrong.

Grading is Hugging Face's ``math-verify``: both answers are parsed to sympy (LaTeX, then plain
expressions) and compared with its ``verify``; when either does not parse, they are compared as
normalised text (spaces, ``\\text{}``, ``$`` and a trailing period dropped), so a word answer
(``yes``) still grades. math-verify bounds parsing and comparison with ``SIGALRM``, which only the main
thread may set, so off the main thread (a reward server's worker) it runs without that bound.
"""

from __future__ import annotations

import re
import threading

from math_verify import parse, verify

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _closing_brace(text: str, start: int) -> int | None:
    """The index of the ``}`` matching the ``{`` at ``start``, or None if it is never closed."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def extract_boxed_answer(text: str | None) -> str | None:
    """What the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``text`` holds (``\\boxed 5``: ``5``), or None."""
    if not text:
        return None
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    rest = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if text.startswith("{", rest):
        end = _closing_brace(text, rest)
        return None if end is None else text[rest + 1 : end].strip()
    match = re.match(r"\s+([^\s$]+)", text[rest:])  # "\boxed 5": the next token
    return match.group(1) if match else None


def _timeout() -> int | None:
    """math-verify's time bound (seconds), where it can be set: the main thread only (SIGALRM)."""
    return 5 if threading.current_thread() is threading.main_thread() else None


def _parsed(answer: str) -> list:
    """``answer`` as math-verify's parsed forms (empty when nothing mathematical was found)."""
    text = answer if any(command in answer for command in _BOX_COMMANDS) else f"${answer}$"
    return parse(text, parsing_timeout=_timeout())


def _normalised(answer: str) -> str:
    """Text for the fallback comparison: no ``\\text{}`` wrapper, ``$``, spaces or trailing period."""
    text = re.sub(r"\\text\{(.*?)\}", r"\1", answer).replace("$", "")
    return re.sub(r"\s+", "", text).rstrip(".").lower()


def grade_answer(given: str | None, reference: str | None) -> bool:
    """Whether ``given`` (an extracted answer, e.g. from ``extract_boxed_answer``) equals ``reference``
    as mathematics (numeric, symbolic or LaTeX equivalence); None on either side is False."""
    if given is None or reference is None:
        return False
    given, reference = str(given).strip(), str(reference).strip()
    if not given or not reference:
        return False
    gold, pred = _parsed(reference), _parsed(given)
    if gold and pred:
        return bool(verify(gold, pred, timeout_seconds=_timeout()))
    return _normalised(given) == _normalised(reference)
