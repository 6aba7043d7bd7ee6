"""``OlympiadBenchProcessor``: OlympiadBench rows (``question``, optional ``context``,
``final_answer``, images in ``image_1`` ... ``image_9``) -> prompts with the final answer kept
for the reward."""

from typing import Any

from twinkle.preprocessor.base import Preprocessor, require_fields
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
    context's label; ``system`` replaces the prompt. A row's images (``image_1`` ... in order,
    empty columns skipped; any value ``Message.images`` takes: Hugging Face's image records, PIL
    images, bytes, paths, base64 ``data:image/`` URIs) go in the user turn's ``images``, each with an ``<image>`` tag before
    the text, as upstream puts the pictures ahead of the problem; a vision-language template
    (``Qwen3_5Template`` on a Qwen3.5 checkpoint) encodes them, and a text template refuses such
    a row in one line (``skip_bad_rows`` drops it)."""

    def __init__(self, system: str | None = None, language: str = "zh"):
        if language not in SYSTEM_PROMPTS:
            raise UserError(f"OlympiadBenchProcessor(language={language!r}): use 'zh' or 'en'")
        self.language = language
        self.system = system if system is not None else SYSTEM_PROMPTS[language]

    def preprocess(self, row: dict[str, Any], index: int | None = None) -> dict[str, Any]:
        require_fields(row, ("question",), index)
        images = [row[name] for name in IMAGE_COLUMNS if row.get(name) is not None]
        context = row.get("context")
        question = row["question"]
        if isinstance(context, str) and context.strip():
            question = f"{CONTEXT_LABEL[self.language]}{context}\n\n{question}"
        answer = row.get("final_answer")
        parts = answer if isinstance(answer, list) else [answer]
        truth = ", ".join(str(a).strip() for a in parts if a not in (None, ""))
        messages = [{"role": "system", "content": self.system}] if self.system else []
        if images:
            messages.append({"role": "user", "content": "<image>" * len(images) + question, "images": images})
        else:
            messages.append({"role": "user", "content": question})
        return {"messages": messages, "user_data": [("ground_truth", truth)]}
