"""Tool calls parsed from each format; every failure an error outcome of its kind, never raised."""

import json
import threading
import time

import pytest

from twinkle.utils.errors import UserError
from twinkle_agentic.tools import FunctionTool, ToolManager, get_format, parse_tool_calls, validate_arguments


def add(a: int, b: int) -> int:
    return a + b


ADD = FunctionTool(
    add,
    description="add two integers",
    parameters={
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
)


def names_and_args(calls):
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_hermes_smollm2_and_qwen3_5_calls_are_read():
    hermes = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}\n</tool_call>'
    smol = '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": {"a": 5, "b": 6}}]</tool_call>'
    qwen = "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>"
    assert names_and_args(parse_tool_calls(hermes)[0]) == [
        ("add", {"a": 1, "b": 2}),
        ("add", {"a": 3, "b": 4}),
    ]
    assert names_and_args(parse_tool_calls(smol)[0]) == [("add", {"a": 1, "b": 2}), ("add", {"a": 5, "b": 6})]
    assert names_and_args(parse_tool_calls(qwen)[0]) == [("add", {"a": 1, "b": 2})]
    assert parse_tool_calls("The answer is 3.") == ([], [])


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("<tool_call>{'name': 'add'}</tool_call>", "not valid JSON"),
        ('<tool_call>{"name": "add", "arguments": {"a": 1}', "not closed"),
        ('<tool_call>{"arguments": {}}</tool_call>', "needs a 'name'"),
        ("<tool_call>[]</tool_call>", "empty list"),
        ("<tool_call>add(1, 2)</tool_call>", "not valid JSON"),
        ("<tool_call><function>x</function></tool_call>", "neither JSON"),
    ],
)
def test_an_unreadable_call_is_an_error_message(text, fragment):
    calls, errors = parse_tool_calls(text)
    assert not calls and len(errors) == 1 and fragment in errors[0] and "\n" not in errors[0]


def test_every_failure_is_an_outcome_of_its_kind():
    def boom(**_):
        raise RuntimeError("disk on fire")

    manager = ToolManager([ADD, FunctionTool(boom, name="boom")], timeout=5)
    ok = manager.execute({"function": {"name": "add", "arguments": {"a": 2, "b": 3}}})
    assert (ok.content, ok.error) == ("5", None)
    cases = {
        "unknown_tool": {"function": {"name": "mul", "arguments": {}}},
        "bad_arguments": {"function": {"name": "add", "arguments": {"a": "x", "b": 1}}},
        "raised": {"function": {"name": "boom", "arguments": {}}},
        "malformed": {"function": {"name": "add", "arguments": "{not json"}},
    }
    for kind, tool_call in cases.items():
        outcome = manager.execute(tool_call)
        assert outcome.error == kind and outcome.content.startswith("Error: "), (kind, outcome)
    assert "the tools are: add, boom" in manager.execute(cases["unknown_tool"]).content
    assert "disk on fire" in manager(cases["raised"])  # upstream's call: the text


def test_schema_failures_say_what_is_wrong():
    schema = ADD.parameters
    assert validate_arguments({"a": 1, "b": 2}, schema) is None
    assert "lack the required 'b'" in validate_arguments({"a": 1}, schema)
    assert "unknown 'c'" in validate_arguments({"a": 1, "b": 2, "c": 3}, schema)
    assert "must be integer" in validate_arguments({"a": True, "b": 2}, schema)
    assert "one of" in validate_arguments("jump", {"type": "string", "enum": ["hit", "stand"]})
    assert "must be object" in validate_arguments([1], schema)


def test_a_hanging_tool_times_out_and_the_call_returns():
    release = threading.Event()
    hang = FunctionTool(lambda: release.wait(30), name="hang")
    manager = ToolManager([hang], timeout=0.2)
    start = time.perf_counter()
    outcome = manager.execute({"function": {"name": "hang", "arguments": {}}})
    assert outcome.error == "timeout" and "within 0.2 s" in outcome.content
    assert time.perf_counter() - start < 5
    release.set()


def test_a_reply_runs_its_readable_calls_after_reporting_the_rest():
    manager = ToolManager([ADD])
    text = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call><tool_call>oops</tool_call>'
    outcomes, asked = manager.execute_reply(text)
    assert asked and [o.error for o in outcomes] == ["malformed", None] and outcomes[1].content == "2"
    assert manager.execute_reply("just an answer") == ([], False)


def test_formats_offer_tools_and_show_results():
    infos = [ADD.tool_info()]
    for name in ("hermes", "smollm2", "qwen3_5"):
        prompt = get_format(name).tools_prompt(infos)
        assert '"add"' in prompt and "<tool_call>" in prompt
    assert (
        json.loads(get_format("smollm2").tools_prompt(infos).split("<tools>")[-1].split("</tools>")[0])
        == infos
    )
    assert get_format("smollm2").observation_messages(["5"]) == [{"role": "tool", "content": "5"}]
    user = get_format("hermes").observation_messages(["5", "7"])
    assert user == [
        {
            "role": "user",
            "content": "<tool_response>\n5\n</tool_response>\n<tool_response>\n7\n</tool_response>",
        }
    ]
    with pytest.raises(UserError, match="known: hermes, smollm2, qwen3_5"):
        get_format("mistral")
    with pytest.raises(UserError, match="non-empty"):
        ToolManager([object()])
