"""Tool-call rows: ``ToolCallProcessor`` + ``Qwen3_5Template`` render them as Qwen3.5's own chat
template does (tools in the system turn, ``<tool_call>`` blocks in the reply, results as
``<tool_response>`` in a user turn), and only the assistant's turns are supervised."""

import json

import pytest
from transformers import AutoTokenizer

from twinkle.dataset import Dataset, DatasetMeta
from twinkle.preprocessor import MessagesProcessor, ToolCallProcessor
from twinkle.template import Qwen3_5Template
from twinkle.template.base import IGNORE_INDEX
from twinkle.utils.errors import UserError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
ROW = {
    "tools": [WEATHER],
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
                {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome", "days": [1, 2]}}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "b", "content": '{"temp": 24}'},
        {"role": "assistant", "content": "Paris 21 C, Rome 24 C."},
    ],
}  # fmt: skip

# Qwen3.5's chat template, written out by hand for ROW: the tool list (each schema as JSON) and the
# call-format instructions open the system turn, then the system text; calls follow the reply's
# text after a blank line, one <tool_call> block each; both results share one user turn.
SYSTEM_TURN = (
    "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", '
    '"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}\n</tools>\n\n'
    "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested "
    "within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function call, "
    "but NOT after\n"
    "- If there is no function call available, answer the question like normal with your current knowledge and "
    "do not tell the user about function calls\n</IMPORTANT>\n\n"
    "You are a helpful assistant.<|im_end|>\n"
)
CALLS_REPLY = (
    "Let me check.\n\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
    "<parameter=days>\n[1, 2]\n</parameter>\n</function>\n</tool_call><|im_end|>"
)
EXPECTED = (
    SYSTEM_TURN
    + "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
    + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    + CALLS_REPLY
    + '\n<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n'
    + '<tool_response>\n{"temp": 24}\n</tool_response><|im_end|>\n'
    + "<|im_start|>assistant\n<think>\n\n</think>\n\nParis 21 C, Rome 24 C.<|im_end|>\n"
)


@pytest.fixture(scope="module")
def template(tiny_model_dir):
    return Qwen3_5Template(AutoTokenizer.from_pretrained(tiny_model_dir), max_length=4096)


def supervised_text(template, out) -> list[str]:
    runs, current = [], []
    for token, label in zip(out["input_ids"], out["labels"], strict=True):
        if label == IGNORE_INDEX:
            runs, current = (runs + [current] if current else runs), []
        else:
            assert label == token
            current.append(token)
    runs += [current] if current else []
    return [template.tokenizer.decode(run) for run in runs]


def test_a_tool_row_renders_as_qwen3_5s_chat_template(template):
    messages = ToolCallProcessor().preprocess(ROW, 0)["messages"]
    assert template.render(messages) == EXPECTED


def test_only_the_assistant_turns_are_supervised(template):
    out = template.encode(ToolCallProcessor().preprocess(ROW, 0)["messages"])
    assert template.tokenizer.decode(out["input_ids"]) == EXPECTED
    # The calls are the model's output and are learnt; the tools, the results and the think block are not.
    assert supervised_text(template, out) == [CALLS_REPLY, "Paris 21 C, Rome 24 C.<|im_end|>"]


def test_the_generation_prompt_after_tool_results(template):
    messages = ToolCallProcessor().preprocess(ROW, 0)["messages"][:5]
    prompt = template.render(messages, add_generation_prompt=True)
    assert prompt.endswith(
        '<tool_response>\n{"temp": 24}\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n'
    )


def test_a_call_without_text_and_tools_without_a_system_message(template):
    row = {
        "tools": json.dumps([WEATHER]),  # tools stored as JSON text, as many data sets do
        "messages": [
            {"role": "user", "content": "Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
            {"role": "tool", "content": "  sunny \n"},
            {"role": "assistant", "content": "Sunny."},
        ],
    }  # fmt: skip
    text = template.render(ToolCallProcessor().preprocess(row)["messages"])
    assert (
        text.startswith("<|im_start|>system\n# Tools\n")
        and "</IMPORTANT><|im_end|>\n<|im_start|>user\nParis?" in text
    )
    assert "<think>\n\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n" in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in text


def test_rows_without_tools_render_as_plain_messages(template):
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    assert template.render(ToolCallProcessor().preprocess(row)["messages"]) == template.render(
        MessagesProcessor().preprocess(row)["messages"]
    )


def test_a_jsonl_of_tool_rows_trains_through_the_dataset(tiny_model_dir, tmp_path):
    """Arrow gives every row the union of the rows' keys (null where absent); the second row's
    schema and arguments must come out without the first row's keys."""
    search = {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    }
    second = {
        "tools": [search],
        "messages": [
            {"role": "user", "content": "Find cats"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": {"query": "cats"}}}]},
            {"role": "tool", "content": "cats!"},
            {"role": "assistant", "content": "Found."},
        ],
    }  # fmt: skip
    first = json.loads(json.dumps(ROW))
    paris = first["messages"][2]["tool_calls"][0]["function"]
    paris["arguments"] = json.loads(paris["arguments"])  # a JSONL column holds one JSON type
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps(first) + "\n" + json.dumps(second) + "\n")
    dataset = Dataset(DatasetMeta(str(path)))
    dataset.map(ToolCallProcessor())
    dataset.set_template("Qwen3_5Template", model_id=str(tiny_model_dir), max_length=4096)
    text = dataset.template.render(dataset[1]["messages"])
    assert (
        '\n{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}\n</tools>'
        in text
    )
    assert (
        "<tool_call>\n<function=search>\n<parameter=query>\ncats\n</parameter>\n</function>\n</tool_call><|im_end|>"
        in text
    )
    assert "<parameter=city>" not in text and "description" not in text
    assert dataset.template.render(dataset[0]["messages"]) == EXPECTED
    dataset.encode()
    assert len(dataset) == 2 and all(any(t != IGNORE_INDEX for t in row["labels"]) for row in dataset)


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        ({"messages": []}, "no 'messages' list"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}]}, "must follow an assistant message with tool_calls"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "s"}]}, "only the first message may be a system"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role in"),
        ({"messages": [{"role": "user", "content": None}]}, "needs a text content"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"name": "f"}]}]}, "only assistant messages call tools"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": {}}}]}]}, "needs a function name"),
        ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": "{oops"}]}]}, "not valid JSON"),
        ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": "[1]"}]}]}, "must be a JSON object"),
        ({"tools": {"name": "f"}, "messages": [{"role": "user", "content": "x"}]}, "'tools' must be a list"),
        ({"tools": [{"type": "function"}], "messages": [{"role": "user", "content": "x"}]}, "each with a function name"),
    ],
)  # fmt: skip
def test_bad_rows_are_one_line_errors_naming_the_row(row, needle):
    with pytest.raises(UserError) as info:
        ToolCallProcessor().preprocess(row, 7)
    assert needle in str(info.value) and str(info.value).startswith("row 7") and "\n" not in str(info.value)
