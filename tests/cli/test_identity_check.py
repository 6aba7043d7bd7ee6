"""``twinkle eval --identity-check``: held-out identity and general questions answered with and
without the adapter, scored and reported."""

import json
import re

from twinkle.cli.identity_check import contains, identity_words, score
from twinkle.cli.main import main
from twinkle.hub.dataset import asset_path
from twinkle.hub.jsonrows import read_json_rows

QUESTIONS = [
    {"kind": "identity", "query": "Who are you?"},
    {"kind": "identity", "query": "你是谁？"},
    {"kind": "general", "query": "Capital of France?", "answers": ["Paris"]},
    {"kind": "general", "query": "一周几天？", "answers": ["7", "七"]},
]


def test_identity_words_and_matching():
    words = identity_words("twinkle大模型", "ModelScope社区")
    assert words == ["twinkle大模型", "ModelScope社区", "twinkle", "ModelScope"]
    assert identity_words("Twinkle", "Starlight Labs") == ["Twinkle", "Starlight Labs"]
    assert contains("I'm Twinkle, made by modelscope.", words) and contains("我是twinkle大模型", words)
    assert not contains("Twinkles are stars", ["twinkle"])  # a Latin word matches whole
    assert contains("一周有七天", ["7", "七"]) and not contains("It has 17 days", ["7"])


def test_score_counts_named_correct_leaking_and_changed_answers():
    tuned = ["I am Twinkle.", "我是助手。", "Paris. I'm Twinkle.", "一周有7天。"]
    base = ["I am SmolLM.", "我是助手。", "Paris.", "一周有7天。"]
    counts = score(QUESTIONS, tuned, base, identity_words("Twinkle", "Acme"))
    assert counts["identity_named"] == {"adapter": 1, "base": 0}
    assert counts["general_correct"] == {"adapter": 2, "base": 2}
    assert counts["general_naming_identity"] == {"adapter": 1, "base": 0}
    assert counts["general_changed"] == 1


def test_bundled_questions_are_held_out():
    questions = read_json_rows(asset_path("identity_check.jsonl"))
    kinds = [q["kind"] for q in questions]
    assert kinds.count("identity") == 24 and kinds.count("general") == 20
    general = [q for q in questions if q["kind"] == "general"]
    assert sum(q["tag"] == "zh" for q in general) == 10 and all(q["answers"] for q in general)
    trained = {row["query"] for row in read_json_rows(asset_path("self_cognition.jsonl"))}
    trained |= {row["query"] for row in read_json_rows(asset_path("general_prompts.jsonl"))}
    assert not trained & {q["query"] for q in questions}


def test_eval_identity_check_prints_the_table_and_writes_the_answers(
    make_model, tiny_model_dir, tmp_path, capsys
):
    checkpoint = make_model(init_lora_weights=False).save("checkpoint-1", output_dir=str(tmp_path / "out"))
    questions, report = tmp_path / "q.jsonl", tmp_path / "report.json"
    questions.write_text("".join(json.dumps(q, ensure_ascii=False) + "\n" for q in QUESTIONS))
    argv = ["eval", "--adapter", str(checkpoint), "--model-id", str(tiny_model_dir), "--identity-check"]
    argv += ["--identity-questions", str(questions), "--max-new-tokens", "4"]
    assert (
        main([*argv, "--identity-report", str(report), "--model-name", "Twinkle", "--model-author", "Acme"])
        == 0
    )
    out = capsys.readouterr().out
    assert re.search(r"identity answers naming the assistant +\d/2 +\d/2", out)
    assert re.search(r"general answers changed from the base +\d/2 +-", out)
    written = json.loads(report.read_text())
    answers = written["answers"]
    assert [a["query"] for a in answers] == [q["query"] for q in QUESTIONS]
    tuned, base = [a["adapter_answer"] for a in answers], [a["base_answer"] for a in answers]
    assert written["counts"] == score(QUESTIONS, tuned, base, identity_words("Twinkle", "Acme"))
    assert main([*argv, "--identity-report", str(tmp_path / "r.txt")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --identity-report {str(tmp_path / 'r.txt')!r} must end in .json or .md"
