"""OlympiadBench rewards, in upstream's names (its multimodal GRPO cookbook, ``rl/grpo/grpo_mm.py``,
weighs them 2:1:1), each in [0, 1]:

- ``OlympiadBenchAccuracyReward``: the boxed answer(s) against the ground truth, with partial
  credit for a near numeric miss and for part of a multi-part answer;
- ``OlympiadBenchFormatReward``: a boxed answer, at the end, stated once;
- ``OlympiadBenchQualityReward``: signs of worked reasoning, a sensible length, no repetition.

The ground truth is ``user_data``'s ``ground_truth`` (``OlympiadBenchProcessor`` joins the row's
``final_answer`` list with ', '). Answers are compared after ``normalize_answer`` rewrites the
LaTeX spellings of one value to one form; scores read the text only, so a completion about an
image is scored as any other."""

import math
import re
from collections.abc import Mapping
from typing import Any

from twinkle.reward.base import Reward, ground_truth_of

RELATIVE_TOLERANCE = 1e-2  # OlympiadBench's physics answers are given to 2-3 significant figures
ABSOLUTE_TOLERANCE = 1e-6  # answers of 0
NEAR_MISS_CREDIT = 0.5  # the most a wrong single answer earns (a numeric near miss)
_FULL_WIDTH = str.maketrans("０１２３４５６７８９，。（）：；－＋", "0123456789,.():;-+")
_DROPPED = re.compile(r"\\left|\\right|\\[,;:! ]|\\quad|\\qquad|\\displaystyle|\$|\s+")
_TEXT_COMMANDS = re.compile(r"\\(?:text|mathrm|mathbf|mathit|operatorname)\{([^{}]*)\}")
_FRACTION = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_ROOT = re.compile(r"\\sqrt\{([^{}]*)\}")
_CONNECTIVES = re.compile(
    r"\b(first|then|next|since|because|therefore|thus|hence|so)\b|首先|然后|因为|所以|因此",
    re.IGNORECASE,
)
_CONCLUSION = re.compile(
    r"(therefore|thus|hence|so|answer|所以|因此|故|答案|综上)[^\n]*?\\boxed", re.IGNORECASE
)


def boxed_answers(text: str) -> list[str]:
    """The contents of every ``\\boxed{...}`` in ``text``, in order (nested braces kept; an
    escaped ``\\{`` or ``\\}`` is a character, not a brace); an unclosed one is left out."""
    found, start = [], text.find("\\boxed{")
    while start >= 0:
        i = begin = start + len("\\boxed{")
        depth = 1
        while i < len(text) and depth:
            if text[i] == "\\" and text[i + 1 : i + 2] in ("{", "}"):
                i += 2
                continue
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth:
            break
        found.append(text[begin : i - 1])
        start = text.find("\\boxed{", i)
    return found


def split_answers(text: str) -> list[str]:
    """``text`` cut at the commas outside brackets: ``'(1,2), 3'`` -> ``['(1,2)', '3']``."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    parts.append(current.strip())
    return [p for p in parts if p]


def normalize_answer(answer: str) -> str:
    """One spelling for one value: full-width digits and punctuation as ASCII, spacing and
    ``\\left``/``\\right`` dropped, ``\\text{x}`` -> ``x``, ``\\frac{a}{b}`` -> ``(a)/(b)``,
    ``\\sqrt{x}`` -> ``sqrt(x)``, ``\\cdot``/``\\times`` -> ``*``, the remaining backslashes
    and a trailing period dropped, lower case."""
    text = answer.translate(_FULL_WIDTH)
    text = _TEXT_COMMANDS.sub(r"\1", text)
    text = _DROPPED.sub("", text)
    for _ in range(3):  # nested fractions and roots, innermost first
        text = _ROOT.sub(r"sqrt(\1)", _FRACTION.sub(r"(\1)/(\2)", text))
    text = text.replace("\\cdot", "*").replace("\\times", "*").replace("\\infty", "inf")
    return text.replace("\\", "").rstrip(".").lower()


def _number(text: str) -> float | None:
    """``text`` as a number (``'1/2'``, ``'(3)/(4)'``, ``'2.5e3'``, ``'50%'``), else None."""
    text = text.strip("()") if text.count("(") == 1 and text.count(")") == 1 else text
    percent = text.endswith("%")
    text = text.rstrip("%")
    try:
        if re.fullmatch(r"\(?-?[\d.]+\)?/\(?-?[\d.]+\)?", text):
            top, bottom = (float(p.strip("()")) for p in text.split("/"))
            value = top / bottom
        else:
            value = float(text)
    except (ValueError, ZeroDivisionError):
        return None
    return value / 100 if percent else value


def _matches(predicted: str, truth: str) -> bool:
    if predicted == truth:
        return True
    a, b = _number(predicted), _number(truth)
    if a is None or b is None:
        return False
    return abs(a - b) <= max(ABSOLUTE_TOLERANCE, RELATIVE_TOLERANCE * abs(b))


def _near_miss(predicted: str, truth: str) -> float:
    """Partial credit for a wrong number: ``NEAR_MISS_CREDIT`` falling linearly to 0 at a relative
    error of 100%, so that among a group's wrong answers the closer ones rank higher."""
    a, b = _number(predicted), _number(truth)
    if a is None or b is None or b == 0 or not math.isfinite(a):
        return 0.0
    return NEAR_MISS_CREDIT * max(0.0, 1.0 - abs(a - b) / abs(b))


class OlympiadBenchAccuracyReward(Reward):
    """The completion's boxed answer against the ground truth.

    One answer in the truth: 1.0 when the last boxed answer equals it (as normalized text, or as
    numbers within ``RELATIVE_TOLERANCE``), else a near miss's partial credit (at most
    ``NEAR_MISS_CREDIT``). Several (``'3, -3'``): the share of them that some boxed answer
    gives (answers may share one box, comma-separated, as the system prompt asks), in any order.
    No boxed answer, or no ground truth: 0.0."""

    name = "accuracy"

    def score(self, completion: str, trajectory: Mapping[str, Any]) -> float:
        truth = ground_truth_of(trajectory)
        boxed = boxed_answers(completion)
        if not boxed or truth in (None, ""):
            return 0.0
        wanted = [normalize_answer(t) for t in split_answers(str(truth))]
        if len(wanted) == 1:
            last = normalize_answer(boxed[-1])
            return 1.0 if _matches(last, wanted[0]) else _near_miss(last, wanted[0])
        given = [normalize_answer(p) for b in boxed for p in split_answers(b)]
        return sum(any(_matches(g, w) for g in given) for w in wanted) / len(wanted)


class OlympiadBenchFormatReward(Reward):
    """The answer's form, whatever its value: 0.5 for a boxed answer, 0.25 more when the last box
    ends the completion (at most ``TAIL`` characters after it: a closing sentence may follow),
    0.25 more when every box states the same answer. No box: 0.0."""

    name = "format"
    TAIL = 100

    def score(self, completion: str, trajectory: Mapping[str, Any]) -> float:
        boxed = boxed_answers(completion)
        if not boxed:
            return 0.0
        value = 0.5
        last = "\\boxed{" + boxed[-1] + "}"
        end = completion.rfind(last) + len(last)
        if len(completion) - end <= self.TAIL:
            value += 0.25
        if len({normalize_answer(b) for b in boxed}) == 1:
            value += 0.25
        return value


class OlympiadBenchQualityReward(Reward):
    """How the solution reads: 0.4 x reasoning + 0.3 x length + 0.3 x (no repetition).

    - reasoning: half for worked equations (four ``=`` or more earn it all), a quarter for
      connectives (first, therefore, 所以 ...), a quarter for a conclusion leading to the box;
    - length: 1.0 from ``SHORT`` to ``LONG`` characters, rising linearly from 0 below, falling
      linearly to 0.25 at four times ``LONG`` above (a rambling answer, not a wrong one);
    - repetition: the share of distinct word 4-grams (characters for text without spaces, as
      Chinese is written), 1.0 for a text too short to repeat."""

    name = "quality"
    SHORT, LONG = 200, 2000

    def _reasoning(self, text: str) -> float:
        equations = len(re.findall(r"(?<![<>=!])=(?!=)", text))
        value = 0.5 * min(1.0, equations / 4)
        value += 0.25 if _CONNECTIVES.search(text) else 0.0
        value += 0.25 if _CONCLUSION.search(text) else 0.0
        return value

    def _length(self, n: int) -> float:
        if n < self.SHORT:
            return n / self.SHORT
        if n <= self.LONG:
            return 1.0
        return max(0.25, 1.0 - 0.75 * (n - self.LONG) / (3 * self.LONG))

    @staticmethod
    def _distinct(text: str) -> float:
        words = text.split()
        units = words if len(words) >= len(text) / 20 else list(text.replace(" ", ""))
        grams = [tuple(units[i : i + 4]) for i in range(len(units) - 3)]
        return 1.0 if len(grams) < 8 else len(set(grams)) / len(grams)

    def score(self, completion: str, trajectory: Mapping[str, Any]) -> float:
        return (
            0.4 * self._reasoning(completion)
            + 0.3 * self._length(len(completion))
            + 0.3 * self._distinct(completion)
        )
