"""Math rows -> chat rows: ``GSM8KProcessor`` (GSM8K ``question``/``answer`` ending in ``#### N``),
``CompetitionMathProcessor`` and ``CompetitionMathGRPOProcessor`` (MATH ``problem``/``solution``).
The prompt-only forms keep the reference answer in ``user_data`` for the reward."""

from typing import Any

from twinkle.preprocessor.base import BadRow, Preprocessor, require_fields
from twinkle.reward.gsm8k import extract_answer

SYSTEM_PROMPT = "Solve the problem. End your reply with the final answer as '#### N'."
MATH_SYSTEM_PROMPT = (
    "You are a helpful math assistant. Respond with only the final answer in the form "
    "\\boxed{...} and nothing else."
)


def _system(system: str | None) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}] if system else []


class GSM8KProcessor(Preprocessor):
    """``row -> {'messages': [system?, user question], 'user_data': [('ground_truth', N)]}``:
    ``N`` is the text after the answer's last ``####`` (``GSM8KAccuracyReward`` compares the
    completion's answer with it). ``system``: the system message (None or '' leaves it out).
    ``add_assistant``: also the reference answer as the assistant turn (a supervised row);
    without it the row is a prompt, which the sampler completes."""

    def __init__(self, system: str | None = SYSTEM_PROMPT, add_assistant: bool = False):
        self.system = system or None
        self.add_assistant = bool(add_assistant)

    def preprocess(self, row: dict[str, Any], index: int | None = None) -> dict[str, Any]:
        require_fields(row, ("question", "answer"), index)
        truth = extract_answer(row["answer"])
        if truth is None or "####" not in row["answer"]:
            raise BadRow(
                index, "answer", ": 'answer' has no final '#### N'; GSM8K answers end with '#### <number>'"
            )
        messages = [*_system(self.system), {"role": "user", "content": row["question"].strip()}]
        if self.add_assistant:
            messages.append({"role": "assistant", "content": row["answer"].strip()})
        return {"messages": messages, "user_data": [("ground_truth", truth)]}


class CompetitionMathProcessor(Preprocessor):
    """``{'problem', 'solution'}`` -> a supervised chat: the problem asked, the solution answered."""

    def preprocess(self, row: dict[str, Any], index: int | None = None) -> dict[str, Any]:
        require_fields(row, ("problem", "solution"), index)
        return {
            "messages": [
                {"role": "user", "content": row["problem"]},
                {"role": "assistant", "content": row["solution"]},
            ]
        }


class CompetitionMathGRPOProcessor(Preprocessor):
    """``{'problem', 'solution'}`` -> a prompt (``system``, then the problem) with the solution
    kept as ``user_data`` ``('solution', text)`` for the reward. ``system``: None or '' leaves
    the system message out."""

    def __init__(self, system: str | None = MATH_SYSTEM_PROMPT):
        self.system = system or None

    def preprocess(self, row: dict[str, Any], index: int | None = None) -> dict[str, Any]:
        require_fields(row, ("problem", "solution"), index)
        messages = [*_system(self.system), {"role": "user", "content": row["problem"]}]
        return {"messages": messages, "user_data": [("solution", row["solution"])]}
