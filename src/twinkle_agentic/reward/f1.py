"""Answer rewards: token F1 between the final answer and the ground truth, and two shaping
bonuses read from the trajectory's messages.

The final answer is the content of the last balanced ``\\boxed{...}`` of the last assistant
reply (else the last match of ``answer_pattern``, when given). Text is compared as SQuAD compares
it: lower case, punctuation and the articles a/an/the removed, split on whitespace. The ground
truth is the trajectory's ``user_data['ground_truth']`` (a string or a list of accepted
answers; upstream's list of ``(key, value)`` pairs is read too); the best-matching one counts."""

import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from twinkle.reward import Reward
from twinkle_agentic.preprocessor.text import content_text

BOXED = "\\boxed{"
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def _extract_final_answer(completion: str) -> str:
    """The stripped content of the last balanced ``\\boxed{...}`` in ``completion`` ('' if none)."""
    answer, start = "", 0
    while (begin := (completion or "").find(BOXED, start)) != -1:
        depth, at = 1, begin + len(BOXED)
        while at < len(completion) and depth:
            depth += {"{": 1, "}": -1}.get(completion[at], 0)
            at += 1
        if depth:  # an unclosed box ends the search; the last closed one stands
            break
        answer, start = completion[begin + len(BOXED) : at - 1].strip(), at
    return answer


def _normalize(text: str) -> list[str]:
    return _ARTICLES.sub(" ", (text or "").lower().translate(_PUNCTUATION)).split()


def _f1_score(prediction: str, gold: str) -> tuple[float, float]:
    """``(f1, exact_match)`` of ``prediction`` against ``gold`` over normalized tokens; two empty
    texts match exactly."""
    predicted, wanted = _normalize(prediction), _normalize(gold)
    exact = float(predicted == wanted)
    if not predicted or not wanted:
        return exact, exact
    same = sum((Counter(predicted) & Counter(wanted)).values())
    if not same:
        return 0.0, exact
    precision, recall = same / len(predicted), same / len(wanted)
    return 2 * precision * recall / (precision + recall), exact


def ground_truths(trajectory: Mapping[str, Any]) -> list[str]:
    """The accepted answers of ``trajectory`` (``user_data['ground_truth']``), non-empty ones."""
    data = trajectory.get("user_data") or {}
    if isinstance(data, Mapping):
        found = data.get("ground_truth")
        values = found if isinstance(found, list | tuple) else [found]
    else:  # upstream's [(key, value), ...]
        values = [value for key, value in data if key == "ground_truth"]
    return [str(v) for v in values if v]


def _assistant_texts(trajectory: Mapping[str, Any]) -> list[str]:
    return [
        content_text(m.get("content"))
        for m in trajectory.get("messages") or []
        if isinstance(m, Mapping) and m.get("role") == "assistant"
    ]


class F1Reward(Reward):
    """Per trajectory: the best token F1 of its final answer against its ground truths (0 or 1 by
    exact match when it has none: an empty answer is then right)."""

    name = "f1"

    def __init__(self, answer_pattern: str | re.Pattern | None = None) -> None:
        self.answer_pattern = (
            re.compile(answer_pattern) if isinstance(answer_pattern, str) else answer_pattern
        )

    def answer(self, completion: str) -> str:
        boxed = _extract_final_answer(completion)
        if boxed or self.answer_pattern is None:
            return boxed
        matches = self.answer_pattern.findall(completion or "")
        last = matches[-1] if matches else ""
        return (last[0] if isinstance(last, tuple) and last else last or "").strip()

    def f1(self, trajectory: Mapping[str, Any]) -> float:
        texts = _assistant_texts(trajectory)
        predicted = self.answer(texts[-1] if texts else "")
        return max(_f1_score(predicted, gold)[0] for gold in ground_truths(trajectory) or [""])

    def __call__(self, trajectories: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[float]:
        return [self.f1(t) for t in trajectories]


class CoTReward(Reward):
    """Per trajectory: 0.3 when its replies hold a ``\\boxed{}`` answer reached in 3 to 6 numbered
    steps (lines opening ``Step <n>.`` or ``Step <n>:``), 0.1 for 7 steps or more, else 0."""

    name = "cot"
    STEP = re.compile(r"(?im)^\s*step\s*(\d+)\s*[.:]")

    def __call__(self, trajectories: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[float]:
        rewards = []
        for trajectory in trajectories:
            text = "\n".join(_assistant_texts(trajectory))
            steps = len({int(n) for n in self.STEP.findall(text)}) if BOXED in text else 0
            rewards.append(0.3 if 3 <= steps <= 6 else 0.1 if steps >= 7 else 0.0)
        return rewards


class ToolExploreReward(Reward):
    """Per trajectory whose answer reaches ``f1_threshold`` (``F1Reward``'s score): 1.0 when 1 to
    3 of its assistant turns called tools and got a useful result back (a tool message right after
    it that is neither empty nor opens with ``ERROR``), 0.5 for more such turns; 0 otherwise."""

    name = "tool_explore"

    def __init__(self, f1_threshold: float = 0.5, answer_pattern: str | re.Pattern | None = None) -> None:
        self.f1_threshold = float(f1_threshold)
        self._f1 = F1Reward(answer_pattern)

    @staticmethod
    def useful_calls(messages: Sequence[Mapping[str, Any]]) -> int:
        useful = 0
        for at, message in enumerate(messages):
            if message.get("role") != "assistant" or not message.get("tool_calls"):
                continue
            results = []
            for after in messages[at + 1 :]:
                if after.get("role") != "tool":
                    break
                results.append(content_text(after.get("content")).strip())
            useful += any(r and not r.startswith("ERROR") for r in results)
        return useful

    def __call__(self, trajectories: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[float]:
        rewards = []
        for trajectory in trajectories:
            if self._f1.f1(trajectory) < self.f1_threshold:
                rewards.append(0.0)
                continue
            useful = self.useful_calls(
                [m for m in trajectory.get("messages") or [] if isinstance(m, Mapping)]
            )
            rewards.append(0.0 if useful == 0 else 1.0 if useful <= 3 else 0.5)
        return rewards
