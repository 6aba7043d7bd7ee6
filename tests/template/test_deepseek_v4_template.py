"""DeepseekV4Template: DeepSeek-V4's chat format written out in chat and thinking mode, checked
against hand-written text; labels on the replies (end marker included) only; generation prompts;
DSML tool calls; one-line refusals. The tokenizer is the tests' tiny one with DeepSeek-V4's
markers added (no DeepSeek-V4 tokenizer is available offline)."""

import shutil

import pytest
from transformers import AutoTokenizer

from twinkle.template import DeepseekV4Template, get_template
from twinkle.template.base import IGNORE_INDEX
from twinkle.template.deepseek_v4 import EFFORT_MAX_PREAMBLE, tools_text
from twinkle.utils.errors import UserError

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
SYSTEM = "You are a helpful assistant."
CHAT = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Who are you?"},
    {"role": "assistant", "content": "I am twinkle.", "reasoning_content": "They ask my name."},
    {"role": "user", "content": "Where is Paris?"},
    {"role": "assistant", "content": "Paris is in France.", "reasoning_content": "A capital."},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_special_tokens(
        {"bos_token": BOS, "eos_token": EOS, "additional_special_tokens": [USER, ASSISTANT]}
    )
    tok.add_tokens(["<think>", "</think>"])  # added, not special: a decoded reply keeps them
    tok.chat_template = None
    return tok


def encoded_text(template, messages, **kwargs):
    row = template.encode(messages, **kwargs)
    text = template.decode(row["input_ids"])
    # every piece ends on a token border: the pieces tokenised apart equal the whole text tokenised
    assert row["input_ids"] == template.tokenizer(text, add_special_tokens=False)["input_ids"]
    return row, text


def supervised_runs(template, row) -> list[str]:
    runs, current = [], []
    for token, label in zip(row["input_ids"], row["labels"], strict=True):
        if label == IGNORE_INDEX:
            runs, current = (runs + [current] if current else runs), []
        else:
            assert label == token
            current.append(token)
    return [template.decode(run) for run in runs + ([current] if current else [])]


def test_chat_mode_text_and_labels(tokenizer):
    template = DeepseekV4Template(tokenizer, enable_thinking=False)
    row, text = encoded_text(template, CHAT)
    assert text == (
        f"{BOS}{SYSTEM}{USER}Who are you?{ASSISTANT}</think>I am twinkle.{EOS}"
        f"{USER}Where is Paris?{ASSISTANT}</think>Paris is in France.{EOS}"
    )
    assert supervised_runs(template, row) == [f"I am twinkle.{EOS}", f"Paris is in France.{EOS}"]


@pytest.mark.parametrize("enable_thinking", [True, None])
def test_thinking_mode_keeps_the_last_turns_reasoning(tokenizer, enable_thinking):
    template = DeepseekV4Template(tokenizer, enable_thinking=enable_thinking)
    row, text = encoded_text(template, CHAT)
    assert text == (
        f"{BOS}{SYSTEM}{USER}Who are you?{ASSISTANT}</think>I am twinkle.{EOS}"
        f"{USER}Where is Paris?{ASSISTANT}<think>A capital.</think>Paris is in France.{EOS}"
    )
    assert supervised_runs(template, row) == [
        f"I am twinkle.{EOS}",
        f"A capital.</think>Paris is in France.{EOS}",
    ]


def test_reasoning_written_in_the_content(tokenizer):
    template = DeepseekV4Template(tokenizer)
    chat = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nGreet.\n</think>\n\nHello."},
    ]
    row, text = encoded_text(template, chat)
    assert text == f"{BOS}{USER}Hi{ASSISTANT}<think>Greet.</think>Hello.{EOS}"
    no_reasoning = [chat[0], {"role": "assistant", "content": "Hello."}]
    assert encoded_text(template, no_reasoning)[1] == f"{BOS}{USER}Hi{ASSISTANT}<think></think>Hello.{EOS}"


def test_reasoning_effort(tokenizer):
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    plain = encoded_text(DeepseekV4Template(tokenizer), chat)[1]
    assert encoded_text(DeepseekV4Template(tokenizer, reasoning_effort="high"), chat)[1] == plain
    maximal = encoded_text(DeepseekV4Template(tokenizer, reasoning_effort="max"), chat)[1]
    assert maximal == BOS + EFFORT_MAX_PREAMBLE + plain[len(BOS) :]
    assert EFFORT_MAX_PREAMBLE.startswith("Reasoning Effort: Absolute maximum with no shortcuts permitted.\n")
    # for one call
    assert encoded_text(DeepseekV4Template(tokenizer), chat, reasoning_effort="max")[1] == maximal


def test_generation_prompt(tokenizer):
    prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who are you?"}]
    for thinking, opener in [(True, "<think>"), (False, "</think>")]:
        template = DeepseekV4Template(tokenizer, enable_thinking=thinking)
        row = template.encode(
            {"messages": [*prompt, {"role": "assistant", "content": ""}]}, add_generation_prompt=True
        )
        assert template.decode(row["input_ids"]) == f"{BOS}{SYSTEM}{USER}Who are you?{ASSISTANT}{opener}"
        assert set(row["labels"]) == {IGNORE_INDEX} and row["messages"][-1]["content"] == ""


def test_a_sampled_reply_decodes_and_joins_the_prompt(tokenizer):
    template = DeepseekV4Template(tokenizer)
    prompt = template.encode({"messages": [{"role": "user", "content": "Hi"}]}, add_generation_prompt=True)
    reply = tokenizer("Greet.</think>Hello." + EOS, add_special_tokens=False)["input_ids"]
    assert template.decode(reply, skip_special_tokens=True) == "Greet.</think>Hello."
    row = template.concat_input_feature(prompt, reply)
    assert row["messages"][-1] == {"role": "assistant", "content": "Greet.</think>Hello."}
    assert row["labels"][-len(reply) :] == reply
    # the row's messages, encoded again, give the same tokens
    assert template.encode(row["messages"])["input_ids"] == row["input_ids"]


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_tool_calls_in_dsml(tokenizer):
    chat = [
        {"role": "system", "content": SYSTEM, "tools": [WEATHER]},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "reasoning_content": "Use the tool.",
            "tool_calls": [
                {"function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}
            ],
        },
        {"role": "tool", "content": "18C"},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "Sunny, 18C.", "reasoning_content": "Report it."},
    ]
    template = DeepseekV4Template(tokenizer, max_length=4096)  # the tool instructions are long
    row, text = encoded_text(template, chat)
    call = (
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    # with tools every turn keeps its reasoning and opens with <think>
    assert text == (
        f"{BOS}{SYSTEM}\n\n{tools_text([WEATHER])}{USER}Weather in Paris?{ASSISTANT}<think>"
        f"Use the tool.</think>Let me check.\n\n{call}{EOS}"
        f"{USER}<tool_result>18C</tool_result>\n\nThanks.{ASSISTANT}<think>Report it.</think>Sunny, 18C.{EOS}"
    )
    assert supervised_runs(template, row) == [
        f"Use the tool.</think>Let me check.\n\n{call}{EOS}",
        f"Report it.</think>Sunny, 18C.{EOS}",
    ]
    schemas = tools_text([WEATHER])
    assert schemas.startswith(
        "## Tools\n\nYou have access to a set of tools to help answer the user's question."
    )
    assert '\n\n{"name": "get_weather", "parameters": ' in schemas
    assert schemas.endswith(
        "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
    )


def test_by_name_and_from_a_folder(tokenizer, tiny_model_dir, tmp_path):
    folder = shutil.copytree(tiny_model_dir, tmp_path / "model")
    tokenizer.save_pretrained(folder)
    template = get_template(
        "DeepseekV4Template", model_id=str(folder), enable_thinking=False, reasoning_effort=None
    )
    assert isinstance(template, DeepseekV4Template) and template.settings()["reasoning_effort"] is None
    from twinkle.cli import CLI

    args = CLI.from_args(["--template-cls", "DeepseekV4Template"], env={})
    assert args.template.template_cls == "DeepseekV4Template"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda tok: DeepseekV4Template(tok, reasoning_effort="low"),
            "reasoning_effort='low' is not one of high, max",
        ),
        (
            lambda tok: DeepseekV4Template(tok, enable_thinking=False, reasoning_effort="max"),
            "reasoning_effort='max' needs DeepSeek-V4's thinking mode",
        ),
        (
            lambda tok: DeepseekV4Template(tok).encode(
                [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}],
                add_generation_prompt=True,
            ),
            "opens the assistant's turn after a user or tool turn; this prompt ends with a turn of role 'assistant'",
        ),
        (
            lambda tok: DeepseekV4Template(tok).encode([{"role": "developer", "content": "Hi"}]),
            "unknown role 'developer'",
        ),
    ],
)
def test_one_line_refusals(tokenizer, make, message):
    with pytest.raises(UserError, match=message) as info:
        make(tokenizer)
    assert "\n" not in str(info.value)


def test_a_tokenizer_without_the_markers_is_refused(tiny_model_dir):
    with pytest.raises(
        UserError, match="DeepseekV4Template writes DeepSeek-V4's format, but the tokenizer"
    ) as info:
        DeepseekV4Template(AutoTokenizer.from_pretrained(tiny_model_dir))
    assert "<｜User｜>" in str(info.value) and "\n" not in str(info.value)


def test_rows_from_tool_call_processor(tokenizer):
    from twinkle.preprocessor import ToolCallProcessor

    call = {"function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
    row = ToolCallProcessor().preprocess(
        {
            "tools": [WEATHER],
            "messages": [
                {"role": "user", "content": "Rome?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "20C"},
                {"role": "assistant", "content": "20C."},
            ],
        }
    )
    text = encoded_text(DeepseekV4Template(tokenizer, enable_thinking=False, max_length=4096), row)[1]
    invoke = (
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    )
    # no system message: the tool list stands alone after an empty system text
    assert text == (
        f"{BOS}\n\n{tools_text([WEATHER])}{USER}Rome?{ASSISTANT}</think>\n\n{invoke}{EOS}"
        f"{USER}<tool_result>20C</tool_result>{ASSISTANT}</think>20C.{EOS}"
    )
    # a row without tools (ToolCallProcessor writes tools='') is a plain chat
    plain = ToolCallProcessor().preprocess(
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    )
    assert (
        encoded_text(DeepseekV4Template(tokenizer), plain)[1]
        == f"{BOS}{USER}Hi{ASSISTANT}<think></think>Hello.{EOS}"
    )
