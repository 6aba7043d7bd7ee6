"""Self-distilled replay: the base model's own greedy answers to general prompts, as training rows.

A LoRA run on identity rows alone learns "mention the identity" and spills it into unrelated
answers. Rows whose answers are what the base model already says teach the adapter "no change"
outside identity questions; mixed with the identity rows they keep the rest of the model as it
was. Everything here is deterministic: greedy decoding, prompts in file order, a fixed mix."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from twinkle.hub.jsonrows import read_json_records
from twinkle.preprocessor.self_cognition import SYSTEM_PROMPT
from twinkle.utils.errors import UserError

# Where a cut-off answer may end: after a sentence's closing mark or at a line break.
_SENTENCE_END = re.compile(r"[.!?。！？](?=\s|$)|[。！？]|\n")
_CJK = re.compile(r"[\u3400-\u9fff]")


def language_tag(text: str) -> str:
    """``zh`` when ``text`` holds a CJK character, else ``en``."""
    return "zh" if _CJK.search(text) else "en"


def read_prompts(path: Path) -> list[dict[str, str]]:
    """The prompts of a JSON-lines (or JSON array) file: each record needs a non-empty text
    ``query``; its ``tag`` is kept, else guessed from the text (``zh``/``en``)."""
    if not path.is_file():
        raise UserError(
            f"prompts file {str(path)!r} does not exist; pass a .jsonl file of {{'query': ...}} rows"
        )
    records, lines = read_json_records(path)
    prompts = []
    for i, record in enumerate(records):
        where = f"{path}:{lines[i]}" if lines is not None else f"{path}: record {i}"
        query = record.get("query")
        if not isinstance(query, str) or not query.strip():
            raise UserError(f"{where}: needs a non-empty text 'query'; fix or remove the row")
        tag = record.get("tag")
        prompts.append({"query": query, "tag": tag if isinstance(tag, str) and tag else language_tag(query)})
    if not prompts:
        raise UserError(f"prompts file {str(path)!r} has no rows; add {{'query': ...}} records")
    return prompts


def finish_answer(text: str, cut_off: bool) -> str:
    """``text`` stripped; an answer that ``max_new_tokens`` cut off ends at its last complete
    sentence (kept whole when it has none), so that a row never teaches the model to stop
    mid-sentence."""
    text = text.strip()
    if not cut_off:
        return text
    ends = [m.end() for m in _SENTENCE_END.finditer(text)]
    return text[: ends[-1]].strip() if ends else text


def greedy_answers(
    model: Any,
    tokenizer: Any,
    template: Any,
    queries: Sequence[str],
    system: str = SYSTEM_PROMPT,
    max_new_tokens: int = 64,
    progress: Callable[[int, int], None] | None = None,
) -> list[tuple[str, bool]]:
    """Each query answered greedily, one at a time (no padding, so each answer is the one the
    model gives alone), under ``system`` and ``template``: ``(text, cut_off)`` where
    ``cut_off`` says the answer reached ``max_new_tokens`` without an end-of-turn token.
    ``progress(done, total)`` is called after each answer."""
    import torch

    eos = tokenizer.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos])
    stops |= {getattr(model.generation_config, "eos_token_id", None)} - {None}
    answers = []
    with torch.no_grad():
        for query in queries:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": query}]
            text = template.render(messages, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
            out = model.generate(
                **ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=template.pad_token_id
            )
            new = out[0, ids["input_ids"].shape[1] :].tolist()
            cut_off = len(new) >= max_new_tokens and not stops.intersection(new)
            answers.append((tokenizer.decode(new, skip_special_tokens=True), cut_off))
            if progress is not None:
                progress(len(answers), len(queries))
    return answers


def replay_rows(
    model: Any,
    tokenizer: Any,
    template: Any,
    prompts: Sequence[dict[str, str]],
    system: str = SYSTEM_PROMPT,
    max_new_tokens: int = 64,
    progress: Callable[[int, int], None] | None = None,
) -> list[dict[str, str]]:
    """``{"query", "response", "tag"}`` rows: the base model's own answers to ``prompts``
    (``finish_answer``); a prompt it answers with nothing is left out."""
    answers = greedy_answers(
        model, tokenizer, template, [p["query"] for p in prompts], system, max_new_tokens
    )
    rows = []
    for prompt, (text, cut_off) in zip(prompts, answers, strict=True):
        response = finish_answer(text, cut_off)
        if response:
            rows.append({"query": prompt["query"], "response": response, "tag": prompt["tag"]})
    return rows


def interleave(identity: Sequence[Any], replay: Sequence[Any]) -> list[Any]:
    """All rows of both lists, each in its own order, spread evenly: at every point of the
    result the share of each kind so far is as close as it can be to its share of the whole
    (150 and 150 rows alternate, 100 and 200 go one identity row to two replay rows). The
    first identity row comes first. Any prefix (an eval slice, a short run) holds both kinds."""
    out: list[Any] = []
    i = r = 0
    while i < len(identity) or r < len(replay):
        # identity next while its consumed share does not lead the replay share
        if r >= len(replay) or (i < len(identity) and i * len(replay) <= r * len(identity)):
            out.append(identity[i])
            i += 1
        else:
            out.append(replay[r])
            r += 1
    return out
