"""``GSM8KProcessor``: GSM8K rows (``question``, ``answer`` ending in ``#### N``) -> prompts a
sampler completes, with the final answer kept for the reward."""

from typing import Any

from twinkle.preprocessor.base import BadRow, Preprocessor, require_fields
from twinkle.reward.gsm8k import extract_answer

SYSTEM_PROMPT = "Solve the problem. End your reply with the final answer as '#### N'."


class GSM8KProcessor(Preprocessor):
    """``row -> {'messages': [system?, user question], 'user_data': [('ground_truth', N)]}``: no
    assistant turn (the sampler writes it); ``N`` is the text after the answer's last ``####``
    (``GSM8KAccuracyReward`` compares the completion's answer with it). ``system``: the system
    message (None or '' leaves it out)."""

    def __init__(self, system: str | None = SYSTEM_PROMPT):
        self.system = system or None

    def __call__(self, row: dict[str, Any], index: int | None = None) -> dict[str, Any]:
        require_fields(row, ("question", "answer"), index)
        truth = extract_answer(row["answer"])
        if truth is None or "####" not in row["answer"]:
            raise BadRow(
                index, "answer", ": 'answer' has no final '#### N'; GSM8K answers end with '#### <number>'"
            )
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": row["question"].strip()})
        return {"messages": messages, "user_data": [("ground_truth", truth)]}
