"""``OlympiadBenchProcessor``: OlympiadBench rows (``question``, optional ``context``,
``final_answer``) -> prompts with the final answer kept for the reward."""

from typing import Any

from twinkle.preprocessor.base import BadRow, Preprocessor, require_fields
from twinkle.utils.errors import UserError

SYSTEM_PROMPTS = {
    "en": (
        "You are a math and physics problem solver. Reason step by step and give the final "
        "answer in \\boxed{}; separate several answers with commas."
    ),
    "zh": "你是数学和物理解题助手。请逐步推理，并把最终答案写在 \\boxed{} 中；多个答案用逗号分隔。",
}
CONTEXT_LABEL = {"en": "Context: ", "zh": "背景信息："}
IMAGE_COLUMNS = tuple(f"image_{i}" for i in range(1, 10))


class OlympiadBenchProcessor(Preprocessor):
    """``row -> {'messages': [system, user], 'user_data': [('ground_truth', answers)]}``.

    The user turn is the ``context`` (when given) then the ``question``; ``answers`` joins the
    ``final_answer`` list with ', ' (the ``unit`` stays out: a completion may or may not name it).
    ``language`` (``'zh'``, the default, or ``'en'``) picks the default system prompt and the
    context's label; ``system`` replaces the prompt. A row with images (``image_1`` ...) is a
    ``BadRow``: image inputs are not supported yet, so ``skip_bad_rows`` keeps the text rows."""

    def __init__(self, system: str | None = None, language: str = "zh"):
        if language not in SYSTEM_PROMPTS:
            raise UserError(f"OlympiadBenchProcessor(language={language!r}): use 'zh' or 'en'")
        self.language = language
        self.system = system if system is not None else SYSTEM_PROMPTS[language]

    def preprocess(self, row: dict[str, Any], index: int | None = None) -> dict[str, Any]:
        require_fields(row, ("question",), index)
        images = [name for name in IMAGE_COLUMNS if row.get(name) is not None]
        if images:
            raise BadRow(
                index,
                images[0],
                f" has images ({', '.join(images)}); OlympiadBench's image inputs are not supported yet",
            )
        context = row.get("context")
        question = row["question"]
        if isinstance(context, str) and context.strip():
            question = f"{CONTEXT_LABEL[self.language]}{context}\n\n{question}"
        answer = row.get("final_answer")
        parts = answer if isinstance(answer, list) else [answer]
        truth = ", ".join(str(a).strip() for a in parts if a not in (None, ""))
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": question})
        return {"messages": messages, "user_data": [("ground_truth", truth)]}
