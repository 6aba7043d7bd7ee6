"""``twinkle_agentic.preprocessor``: each quality step keeps good chat rows and drops the defect
it names; ``QualityPreprocessor`` runs them in order and logs every dropped row."""

import json

import pytest

from twinkle.utils.errors import UserError
from twinkle_agentic.preprocessor import (
    DeadLoopFilter,
    DedupFilter,
    FixUnicodeFilter,
    HardFilter,
    MessageSanityFilter,
    QualityPreprocessor,
    RefuseFilter,
    RemoveRepeatSentencesFilter,
    SpecialCharsFilter,
    TokenNumFilter,
    TokenSoupFilter,
)


def chat(user, reply, **extra):
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply, **extra}]}


GOOD = chat("How many legs does a spider have?", "A spider has eight legs, arranged in four pairs.")


def reasons(step, rows):
    kept, dropped = step(rows)
    assert len(kept) + len(dropped) == len(rows)
    return [r.get("drop_reason") for r in dropped]


def test_hard_filter():
    rows = [
        GOOD,
        chat("hi", "Hello!"),  # too short a question
        {"messages": [{"role": "user", "content": "What is the boiling point of water?"}]},  # no answer
        {"messages": [{"role": "assistant", "content": "unprompted"}]},
        chat("北京的人口是多少", "约两千万。"),  # 8 CJK characters pass the CJK bound of 6
    ]
    assert reasons(HardFilter(), rows) == ["user_turn_too_short", "no_final_answer", "no_user_turn"]
    assert reasons(HardFilter(max_total_chars=40), [GOOD]) == ["too_long"]
    system = {"messages": [{"role": "system", "content": "You are DAN."}, *GOOD["messages"]]}
    assert reasons(HardFilter(system_deny_keywords=["dan"]), [system, GOOD]) == ["system_keyword"]


def test_refuse_filter_reads_the_reply_opening():
    refusal = chat("Tell me how to pick a lock please.", "I'm sorry, but I can't help with that request.")
    late = chat("Tell me about locks, in detail.", "x" * 700 + " I cannot help with that.")
    chinese = chat("请告诉我怎么做这件事情", "抱歉，我无法提供这方面的帮助。")
    assert reasons(RefuseFilter(), [GOOD, refusal, late, chinese]) == ["refusal", "refusal"]
    with pytest.raises(UserError):
        RefuseFilter(check_window=0)


def test_dead_loop_filter_catches_a_reply_stuck_in_a_loop():
    loop = chat("Explain recursion to me briefly.", "Wait, let me think about this again. " * 20)
    thinking = chat(
        "Explain recursion to me briefly.", "Short answer.", reasoning_content="Hmm, so the base case. " * 30
    )
    varied = chat("Count for me.", " ".join(f"number {i} comes after {i - 1}." for i in range(1, 60)))
    assert reasons(DeadLoopFilter(), [GOOD, loop, thinking, varied]) == ["dead_loop", "dead_loop"]


def test_token_soup_and_special_chars():
    garbled = chat("What does this file say?", "Th\ufffds \ufffds g\ufffdrbl\ufffdd t\ufffdxt")
    control = chat("What does this file say?", "text\x00\x01\x02 with control bytes")
    assert reasons(TokenSoupFilter(), [GOOD, garbled, control]) == ["replacement_chars", "control_chars"]
    symbols = chat("Draw me a box please.", "+--+--+--+ |##|##|##| +--+--+--+")
    assert reasons(SpecialCharsFilter(), [GOOD, symbols]) == ["special_chars"]


def test_dedup_keeps_the_longest_copy_in_its_place():
    short = chat("How many legs does a spider have?", "Eight.")
    copy = chat("How many legs does a spider have?", "Eight.")
    longest = {"messages": [*short["messages"], {"role": "user", "content": "And an ant?"}]}
    kept, dropped = DedupFilter()([short, GOOD, longest, copy])
    assert kept == [GOOD, longest]
    assert [d["drop_reason"] for d in dropped] == ["duplicate", "duplicate"]


def test_message_sanity_filter():
    tool_ok = {
        "messages": [
            {"role": "user", "content": "What is 2+2? Use the tool."},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"name": "add"}}]},
            {"role": "tool", "content": "4", "tool_call_id": "c1"},
            {"role": "assistant", "content": "4"},
        ]
    }
    wrong_id = json.loads(json.dumps(tool_ok))
    wrong_id["messages"][2]["tool_call_id"] = "c9"
    orphan = {"messages": [GOOD["messages"][0], {"role": "tool", "content": "4"}, GOOD["messages"][1]]}
    two_users = {"messages": [GOOD["messages"][0], *GOOD["messages"]]}
    late_system = {"messages": [GOOD["messages"][0], {"role": "system", "content": "x"}, GOOD["messages"][1]]}
    trailing = {"messages": [*GOOD["messages"], {"role": "user", "content": "thanks"}]}
    rows = [GOOD, tool_ok, wrong_id, orphan, two_users, late_system, trailing, {"messages": "text"}]
    kept, dropped = MessageSanityFilter()(rows)
    assert [d["drop_reason"] for d in dropped] == [
        "tool_result_names_no_call",
        "tool_result_without_call",
        "two_user_turns_in_a_row",
        "system_not_first",
        "messages_not_a_list_of_dicts",
    ]
    assert kept == [GOOD, tool_ok, GOOD]  # the trailing user turn is cut off
    assert reasons(MessageSanityFilter(min_turns=3), [GOOD]) == ["too_few_turns"]
    assert reasons(MessageSanityFilter(max_msg_chars=10), [GOOD]) == ["message_too_long"]


def test_text_rewrites_drop_nothing():
    decomposed = chat("Where is the cafe?", "Cafe\u0301 de\u200b Flore.")
    (fixed,), dropped = FixUnicodeFilter()([decomposed])
    assert dropped == [] and fixed["messages"][1]["content"] == "Café de Flore."
    assert (
        decomposed["messages"][1]["content"] == "Cafe\u0301 de\u200b Flore."
    )  # the input row is left as it was
    repeated = chat("Say it.", "It works. It works! It works.\nReally, it works. Pi is 3.14. Yes. Yes.")
    (once,), _ = RemoveRepeatSentencesFilter()([repeated])
    assert once["messages"][1]["content"] == "It works.\nReally, it works. Pi is 3.14. Yes."
    assert once["messages"][0] == repeated["messages"][0]


def test_token_num_filter_counts_with_the_model_tokenizer(tiny_model_dir):
    short = chat("Answer in one word please.", "Yes.")
    kept, dropped = TokenNumFilter(hf_tokenizer=str(tiny_model_dir), min_num=5, max_num=200)([GOOD, short])
    assert kept == [GOOD] and dropped[0]["drop_reason"] == "token_count_out_of_range"
    with pytest.raises(UserError):
        TokenNumFilter(min_num=5, max_num=4)


def test_quality_preprocessor_runs_the_steps_in_order_and_logs_the_drops(tmp_path):
    log = tmp_path / "logs" / "dropped.jsonl"
    log.parent.mkdir()
    log.write_text("an old line\n")
    refusal = chat("Tell me how to pick a lock please.", "I'm sorry, but I can't help with that.")
    processor = QualityPreprocessor(
        [HardFilter(), RefuseFilter(), FixUnicodeFilter()], dropped_log_path=str(log)
    )
    assert log.read_text() == ""
    rows = [GOOD, chat("hi", "Hello!"), refusal]
    columns = {"messages": [r["messages"] for r in rows], "id": [1, 2, 3]}
    out = processor(columns)
    assert out == {"messages": [GOOD["messages"]], "id": [1]}
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(e["step"], e["row"]["id"], e["row"]["drop_reason"]) for e in logged] == [
        ("HardFilter", 2, "user_turn_too_short"),
        ("RefuseFilter", 3, "refusal"),
    ]
    assert processor({"messages": [rows[1]["messages"]], "id": [2]}) == {"messages": [], "id": []}
    with pytest.raises(UserError):
        QualityPreprocessor([])
