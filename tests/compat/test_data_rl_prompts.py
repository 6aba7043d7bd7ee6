"""Prompt-only RL data in upstream's shape (``short_math_grpo.py``): ``dataset.map(
GSM8KProcessor(system=...))``, ``dataset.encode(add_generation_prompt=True)``, each loader row
given to ``sampler.sample`` as a prompt and the sampled rows to a reward that reads
``row['messages']``; the other math processors on their bundled fixtures."""

import json

import pytest

from twinkle.data_format import SamplingParams
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta, LazyDataset
from twinkle.hub.dataset import asset_path
from twinkle.preprocessor import CompetitionMathGRPOProcessor, OlympiadBenchProcessor
from twinkle.preprocessor.llm import GSM8KProcessor
from twinkle.preprocessor.olympiad_bench import OlympiadBenchProcessor as FromModule
from twinkle.reward import GSM8KAccuracyReward
from twinkle.sampler import TorchSampler
from twinkle.template.base import IGNORE_INDEX
from twinkle.utils.errors import UserError

SYSTEM = "Answer with '#### N'."
GSM8K = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A box holds 10 pens; 6 are taken. How many are left?", "answer": "10 - 6 = 4\n#### 4"},
    {"question": "Sara reads 5 pages a day for 2 days. How many pages?", "answer": "5 * 2 = 10\n#### 10"},
    {"question": "What is 9 minus 9?", "answer": "#### 0"},
]


@pytest.fixture
def gsm8k_dir(tmp_path):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    return str(tmp_path)


def create_gsm8k_dataset(folder, model_dir, dataset_cls=Dataset):
    """The upstream script's dataset function, its hub id replaced by a local folder."""
    dataset = dataset_cls()
    dataset.add_dataset(DatasetMeta(folder, subset_name="main", split="train"))
    dataset.set_template("Template", model_id=str(model_dir), max_length=256, truncation_strategy="delete")
    dataset.map(GSM8KProcessor(system=SYSTEM))
    dataset.encode(add_generation_prompt=True)
    return dataset


def test_prompt_rows_feed_the_sampler_and_the_reward(gsm8k_dir, tiny_model_dir):
    dataset = create_gsm8k_dataset(gsm8k_dir, tiny_model_dir)
    row = dataset[0]
    assert row["messages"] == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": GSM8K[0]["question"]},
    ]
    assert row["user_data"] == [["ground_truth", "7"]] and set(row["labels"]) == {IGNORE_INDEX}
    text = dataset.template.tokenizer.decode(row["input_ids"])
    assert text.endswith(dataset.template.render(row["messages"], add_generation_prompt=True)[-20:])
    sampler = TorchSampler(str(tiny_model_dir))
    for batch in DataLoader(dataset=lambda: dataset, batch_size=2, min_batch_size=2):
        prompts = [prompt for prompt in batch for _ in range(2)]  # NUM_GENERATIONS = 2
        responses = sampler.sample(prompts, SamplingParams(max_tokens=3, num_samples=1, logprobs=1, seed=0))
        rows = [seq.new_input_feature for response in responses for seq in response.sequences]
        assert [r["messages"][:2] for r in rows] == [p["messages"] for p in prompts]
        assert all(r["messages"][-1]["role"] == "assistant" for r in rows)
        rewards = GSM8KAccuracyReward()(rows)
        assert len(rewards) == 4 and set(rewards) <= {0.0, 1.0}
        # the sampled rows keep the prompt's user_data: a reply with that answer scores 1
        right = [
            {
                **r,
                "messages": [
                    *r["messages"][:2],
                    {
                        "role": "assistant",
                        "content": f"#### {dict(map(tuple, r['user_data']))['ground_truth']}",
                    },
                ],
            }
            for r in rows
        ]
        assert GSM8KAccuracyReward()(right) == [1.0] * 4


def test_a_lazy_dataset_gives_the_same_prompts(gsm8k_dir, tiny_model_dir):
    eager = create_gsm8k_dataset(gsm8k_dir, tiny_model_dir)
    lazy = create_gsm8k_dataset(gsm8k_dir, tiny_model_dir, LazyDataset)
    assert [lazy[i]["input_ids"] for i in range(len(lazy))] == [
        eager[i]["input_ids"] for i in range(len(eager))
    ]
    assert lazy[1]["user_data"] == [("ground_truth", "4")]


def test_a_reply_in_a_prompt_row_is_a_bad_row(gsm8k_dir, tiny_model_dir):
    dataset = Dataset(DatasetMeta(gsm8k_dir, subset_name="main"))
    dataset.set_template("Template", model_id=str(tiny_model_dir), max_length=256)
    dataset.map(GSM8KProcessor(system=SYSTEM, add_assistant=True))
    assert dataset[0]["messages"][-1] == {"role": "assistant", "content": GSM8K[0]["answer"]}
    with pytest.raises(
        UserError, match="ends with an assistant reply, but a prompt ends with the user's turn"
    ):
        dataset.encode(add_generation_prompt=True)
    assert len(dataset.encode()) == len(GSM8K)  # with the reply: supervised rows


def test_competition_math_prompts_keep_the_solution(tiny_model_dir):
    dataset = Dataset(DatasetMeta(str(asset_path("competition_math_tiny.jsonl"))))
    dataset.set_template("Template", model_id=str(tiny_model_dir), max_length=256)
    dataset.map("CompetitionMathGRPOProcessor").encode(add_generation_prompt=True)
    assert len(dataset) == 3 and dataset[0]["messages"][-1]["role"] == "user"
    assert dict(map(tuple, dataset[0]["user_data"]))["solution"].endswith("\\boxed{14}$.")
    assert CompetitionMathGRPOProcessor(system="")({"problem": ["p"], "solution": ["s"]})["messages"] == [
        [{"role": "user", "content": "p"}]
    ]


def test_olympiad_bench_text_rows_and_image_rows(tiny_model_dir):
    assert FromModule is OlympiadBenchProcessor
    path = str(asset_path("olympiad_bench_tiny.jsonl"))
    dataset = Dataset(DatasetMeta(path)).map(OlympiadBenchProcessor(language="en"))
    truths = [dict(map(tuple, dataset[i]["user_data"]))["ground_truth"] for i in range(len(dataset))]
    assert truths == ["40", "3, -3", "10", "7"]
    assert (
        dataset[2]["messages"][1]["content"]
        == "Context: The triangle has base 4 and height 5.\n\nWhat is the area of the triangle?"
    )
    assert dataset[3]["messages"][1]["content"].startswith("<image>") and dataset[3]["messages"][1]["images"]
    dataset.set_template("Template", model_id=str(tiny_model_dir), max_length=256)
    # the text template reads no image: the image row is one line, and skip_bad_rows drops it
    with pytest.raises(
        UserError, match="olympiad_bench_tiny.jsonl:4: row 3: messages.1. has images, but Template"
    ):
        dataset.encode(add_generation_prompt=True)
    dataset = Dataset(DatasetMeta(path), skip_bad_rows=True).map(OlympiadBenchProcessor(language="en"))
    dataset.set_template("Template", model_id=str(tiny_model_dir), max_length=256).encode(
        add_generation_prompt=True
    )
    assert len(dataset) == 3
    with pytest.raises(UserError, match="language='fr'"):
        OlympiadBenchProcessor(language="fr")
