"""``AlpacaProcessor``: Alpaca rows (``instruction``, optional ``input``, ``output``) as chat messages."""

from typing import Any

from twinkle.preprocessor.base import Preprocessor, require_fields


class AlpacaProcessor(Preprocessor):
    """The user turn is the instruction, followed by the input (when not empty) after a blank
    line; the assistant turn is the output. An optional ``system`` field becomes the system turn."""

    def preprocess(self, row: dict[str, Any], index: int | None = None) -> dict[str, Any]:
        require_fields(row, ("instruction", "output"), index)
        extra = row.get("input")
        user = row["instruction"] if not extra else f"{row['instruction']}\n\n{extra}"
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]
        if isinstance(row.get("system"), str) and row["system"]:
            messages.insert(0, {"role": "system", "content": row["system"]})
        return {"messages": messages}
