"""GSM8K-style rewards: the final answer is the number after ``####`` or inside the last
``\\boxed{...}``."""

import re
from collections.abc import Mapping
from typing import Any

from twinkle.reward.base import Reward, ground_truth_of

_HASHES = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
_NUMBER = re.compile(r"-?[\d,]*\.?\d+")
_HASHES_AT_END = re.compile(r"####\s*-?[\d,]*\.?\d+\.?\s*$")  # a final period may end the sentence
_CLOSING = " \t\n.$\\])"  # what may close a \boxed{} answer: punctuation, the end of LaTeX math
TOLERANCE = 1e-6  # answers are compared as numbers: "72", "72.0" and "72.00" are the same answer


def _boxed_span(text: str) -> tuple[int, int] | None:
    """Where the last ``\\boxed{...}``'s contents start and its closing brace is (nested braces
    allowed), None without a closed one."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return i, j
    return None


def _last_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}``, None without one."""
    span = _boxed_span(text)
    return None if span is None else text[span[0] : span[1]].strip()


def extract_answer(text: str) -> str | None:
    """The final answer of ``text``: the last ``\\boxed{}``'s contents, else the number after the
    last ``####``; commas and spaces removed. None when the text gives neither."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.replace(",", "").replace(" ", "") or None
    found = _HASHES.findall(text)
    return found[-1].replace(",", "") if found else None


def _as_number(text: str) -> float | None:
    match = _NUMBER.fullmatch(text.replace(",", "").strip())
    return float(match.group()) if match else None


def same_answer(predicted: str | None, truth: Any) -> bool:
    """Whether ``predicted`` is the ground truth: numerically when both are numbers (the truth may
    be a bare number or GSM8K's ``... #### 72``), else as equal strings."""
    if predicted is None or truth is None:
        return False
    truth_text = str(truth)
    truth_answer = extract_answer(truth_text) or truth_text.strip().replace(",", "")
    a, b = _as_number(predicted), _as_number(truth_answer)
    if a is not None and b is not None:
        return abs(a - b) <= TOLERANCE * max(1.0, abs(b))
    return predicted == truth_answer


class GSM8KAccuracyReward(Reward):
    """1.0 when the completion's final answer equals the trajectory's ``ground_truth``, else 0.0."""

    name = "accuracy"

    def score(self, completion: str, trajectory: Mapping[str, Any]) -> float:
        return 1.0 if same_answer(extract_answer(completion), ground_truth_of(trajectory)) else 0.0


class GSM8KFormatReward(Reward):
    """1.0 when the completion states one final answer in the expected form (``#### N`` or
    ``\\boxed{N}``) and ends with it (only whitespace, or after ``\\boxed{}`` closing marks such
    as ``$``, ``.``, ``\\]``, may follow), else 0.0: it rewards the form, whatever the number.
    A completion that lists several answers (``#### 5 #### 2 ...``, whose last one the accuracy
    reward would read) or runs on after its answer does not have the form."""

    name = "format"

    def score(self, completion: str, trajectory: Mapping[str, Any]) -> float:
        if extract_answer(completion) is None or completion.count("####") + completion.count("\\boxed{") != 1:
            return 0.0
        if "####" in completion:
            return 1.0 if _HASHES_AT_END.search(completion) else 0.0
        return 1.0 if not completion[_boxed_span(completion)[1] + 1 :].strip(_CLOSING) else 0.0
