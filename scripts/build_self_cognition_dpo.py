"""Write the bundled preference set ``self_cognition_dpo.jsonl`` and its held-out split
``self_cognition_dpo_eval.jsonl`` (in ``src/twinkle/hub/assets``) from the identity rows of
``self_cognition_mixed.jsonl``.

Each row is ``{"prompt", "chosen", "rejected", "tag"}``: ``chosen`` is the identity answer as the
configured assistant, with the ``{{NAME}}``/``{{AUTHOR}}`` placeholders that
``SelfCognitionDPOProcessor`` fills; ``rejected`` is a wrong or generic identity:

- a question that names another assistant ("Are you Claude?") gets that identity's "yes";
- otherwise the same answer with another assistant's name and maker in the placeholders
  (the two replies then differ only in the identity), or, for every fourth row, a generic
  answer with no identity at all.

Every fifth row of each language goes to the held-out split, so its prompts are never trained
on. The output depends on the input rows alone: ``python scripts/build_self_cognition_dpo.py``
rewrites the same files."""

import json
import sys
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "src" / "twinkle" / "hub" / "assets"
EVAL_EVERY = 5  # row k of a language with k % EVAL_EVERY == EVAL_AT is held out
EVAL_AT = 2
GENERIC_EVERY = 4  # row k of a language with k % GENERIC_EVERY == GENERIC_EVERY - 1 gets a generic answer

# (names a question may use, (English name, maker), (Chinese name, maker))
IDENTITIES = [
    (("ChatGPT", "GPT-4", "OpenAI"), ("ChatGPT", "OpenAI"), ("ChatGPT", "OpenAI")),
    (("Qwen", "通义千问", "Alibaba", "阿里巴巴"), ("Qwen", "Alibaba Cloud"), ("通义千问", "阿里云")),
    (("Claude", "Anthropic"), ("Claude", "Anthropic"), ("Claude", "Anthropic")),
    (("Gemini", "Google", "谷歌"), ("Gemini", "Google"), ("Gemini", "谷歌")),
    (("Llama", "Meta"), ("Llama", "Meta AI"), ("Llama", "Meta")),
    (("SmolLM",), ("SmolLM", "Hugging Face"), ("SmolLM", "Hugging Face")),
    (("文心一言",), ("ERNIE Bot", "Baidu"), ("文心一言", "百度")),
    # voice assistants: only as the answer to a question that names them
    (("Siri",), ("Siri", "Apple"), ("Siri", "苹果")),
    (("Alexa",), ("Alexa", "Amazon"), ("Alexa", "亚马逊")),
    (("小爱同学",), ("XiaoAI", "Xiaomi"), ("小爱同学", "小米")),
]
LANGUAGE_MODELS = 7  # the first entries: the identities substituted into plain answers
YES = {
    "en": "Yes, I am {name}, an AI assistant developed by {author}.",
    "zh": "是的，我是{name}，由{author}开发的人工智能助手。",
}
GENERIC = {
    "en": [
        "I am an AI language model. I don't have a name of my own, and no particular company made me.",
        "I'm just a large language model; I have no name or developer I can tell you about.",
        "I am a generic AI assistant without a specific name or creator.",
    ],
    "zh": [
        "我只是一个人工智能语言模型，没有自己的名字，也不是哪家公司开发的。",
        "我是一个大语言模型，没有可以告诉你的名字或开发者。",
        "我是一个通用的AI助手，没有特定的名字和开发者。",
    ],
}


def identity_rows(mixed: Path) -> list[dict]:
    """The rows of ``mixed`` whose answer holds a placeholder (the replay rows hold none)."""
    rows = [json.loads(line) for line in mixed.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r for r in rows if "{{NAME}}" in r["response"] or "{{AUTHOR}}" in r["response"]]


def _named(query: str) -> tuple | None:
    return next((entry for entry in IDENTITIES if any(alias in query for alias in entry[0])), None)


def rejected_answer(row: dict, k: int) -> str:
    """The wrong or generic identity for row ``k`` of its language (module docstring)."""
    tag = row["tag"]
    named = _named(row["query"])
    if named is not None:
        name, author = named[1] if tag == "en" else named[2]
        return YES[tag].format(name=name, author=author)
    if k % GENERIC_EVERY == GENERIC_EVERY - 1:
        return GENERIC[tag][(k // GENERIC_EVERY) % len(GENERIC[tag])]
    for step in range(LANGUAGE_MODELS):
        entry = IDENTITIES[(k + step) % LANGUAGE_MODELS]
        name, author = entry[1] if tag == "en" else entry[2]
        if name not in row["response"]:
            return row["response"].replace("{{NAME}}", name).replace("{{AUTHOR}}", author)
    raise AssertionError(f"no other identity fits {row['response']!r}")


def build(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """``(train, held_out)`` preference rows, in the order of ``rows``."""
    train, held_out, seen = [], [], {"en": 0, "zh": 0}
    for row in rows:
        k = seen[row["tag"]]
        seen[row["tag"]] += 1
        pair = {
            "prompt": row["query"],
            "chosen": row["response"],
            "rejected": rejected_answer(row, k),
            "tag": row["tag"],
        }
        (held_out if k % EVAL_EVERY == EVAL_AT else train).append(pair)
    return train, held_out


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def main(assets: Path = ASSETS) -> None:
    train, held_out = build(identity_rows(assets / "self_cognition_mixed.jsonl"))
    _write(assets / "self_cognition_dpo.jsonl", train)
    _write(assets / "self_cognition_dpo_eval.jsonl", held_out)
    print(f"wrote {len(train)} training and {len(held_out)} held-out pairs to {assets}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ASSETS)
