"""Upstream's OlympiadBench shapes with images: ``OlympiadBenchProcessor`` puts a row's images in
its user turn, a LazyDataset with ``Qwen3_5Template`` on a Qwen3.5 checkpoint encodes them
(the bundled file's image row is a base64 PNG), and the three rewards score completions."""

import sys
from pathlib import Path

import pytest

from twinkle.dataset import DatasetMeta, LazyDataset
from twinkle.hub.dataset import asset_path
from twinkle.preprocessor.olympiad_bench import OlympiadBenchProcessor
from twinkle.reward.olympiad_bench import (
    OlympiadBenchAccuracyReward,
    OlympiadBenchFormatReward,
    OlympiadBenchQualityReward,
    boxed_answers,
    normalize_answer,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "assets"))


def _trajectory(completion, truth="40"):
    return {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": completion}],
        "user_data": [("ground_truth", truth)],
    }


def test_the_processor_puts_a_rows_images_before_its_question():
    from tiny_qwen3_vl import picture

    first, second = picture((64, 64), (200, 30, 30)), picture((32, 32), (30, 30, 200))
    row = {
        "question": "Which is larger?",
        "final_answer": ["A"],
        "image_1": first,
        "image_2": None,
        "image_3": second,
    }
    out = OlympiadBenchProcessor(language="en").preprocess(row, 0)
    user = out["messages"][1]
    assert user == {"role": "user", "content": "<image><image>Which is larger?", "images": [first, second]}
    text = OlympiadBenchProcessor(language="en").preprocess({"question": "q", "final_answer": ["1"]}, 0)
    assert "images" not in text["messages"][1]


def test_the_bundled_image_row_encodes_on_a_qwen3_5_checkpoint(tmp_path):
    from tiny_qwen3_5_vl import build_tiny_qwen3_5_vl

    folder = str(build_tiny_qwen3_5_vl(tmp_path / "q35"))
    meta = DatasetMeta(str(asset_path("olympiad_bench_tiny.jsonl")))
    dataset = LazyDataset(meta)
    dataset.map(OlympiadBenchProcessor(language="zh"), dataset_meta=meta)
    dataset.set_template("Qwen3_5Template", model_id=folder, max_length=512, enable_thinking=False)
    # upstream's scripts hand the rows to the sampler, which encodes each prompt with the template
    image_row, text_row = (dataset.template.encode(dataset[i], add_generation_prompt=True) for i in (3, 0))
    assert image_row["image_grid_thw"].tolist() == [[1, 4, 4]]  # the 64x64 picture of a 7
    image_id = dataset.template.image_token_id
    assert sum(t == image_id for t in image_row["input_ids"]) == 4
    assert "pixel_values" not in text_row and image_id not in text_row["input_ids"]
    assert dict(map(tuple, dataset[3]["user_data"]))["ground_truth"] == "7"


def test_a_bad_data_uri_is_one_line_naming_the_row():
    from twinkle.template.images import BadImage, load_image

    with pytest.raises(
        BadImage, match=r"row 3: image_1 is a data URI whose base64 data does not decode"
    ) as info:
        load_image("data:image/png;base64,@@@", 3, "image_1")
    assert "\n" not in str(info.value)


def test_boxed_answers_and_normalization():
    assert boxed_answers(r"a \boxed{x^{2}} b \boxed{\{1,2\}} c \boxed{open") == ["x^{2}", r"\{1,2\}"]
    assert (
        normalize_answer(r"\dfrac{\sqrt{3}}{2}") == normalize_answer(r"\frac{\sqrt{3}}{2}") == "(sqrt(3))/(2)"
    )
    assert normalize_answer("４０") == "40" and normalize_answer(r"\text{km}") == "km"


@pytest.mark.parametrize(
    ("completion", "truth", "expected"),
    [
        (r"so the speed is \boxed{40}", "40", 1.0),
        (r"\boxed{40.2}", "40", 1.0),  # within 1%
        (r"\boxed{44}", "40", 0.5 * (1 - 0.1)),  # a near miss: half credit less the 10% error
        (r"\boxed{120}", "40", 0.0),
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{-3, 3}", "3, -3", 1.0),  # several answers, any order
        (r"\boxed{3}", "3, -3", 0.5),
        (r"\boxed{2} then \boxed{40}", "40", 1.0),  # the last box is the answer
        ("40, no box", "40", 0.0),
        (r"\boxed{40}", "", 0.0),
    ],
)
def test_accuracy(completion, truth, expected):
    assert OlympiadBenchAccuracyReward()([_trajectory(completion, truth)]) == [pytest.approx(expected)]


def test_format():
    reward = OlympiadBenchFormatReward()
    long_tail = r"\boxed{40}" + " and more words" * 20
    scores = reward(
        [_trajectory(c) for c in (r"x = 40, so \boxed{40}.", long_tail, r"\boxed{4} or \boxed{40}", "40")]
    )
    assert scores == [1.0, 0.75, 0.75, 0.0]


def test_quality_prefers_worked_reasoning_to_repetition_and_to_a_bare_answer():
    worked = (
        "First, the distance is d = 60 km and the time is t = 1.5 h. Since v = d / t, we get "
        "v = 60 / 1.5 = 40 km/h. Checking: 40 * 1.5 = 60, which is the distance given in the "
        "problem, so the speed is consistent with both values. Therefore the answer is \\boxed{40}."
    )
    repeated = "the speed is forty " * 40 + r"\boxed{40}"
    scores = OlympiadBenchQualityReward()([_trajectory(c) for c in (worked, repeated, r"\boxed{40}")])
    assert scores[0] > scores[1] and scores[0] > scores[2]
    assert all(0.0 <= s <= 1.0 for s in scores)


def test_an_image_row_on_a_text_sampler_is_one_line(tiny_model_dir):
    """A text template would sample the question without its picture: refused instead."""
    from twinkle.data_format import SamplingParams
    from twinkle.sampler import TorchSampler
    from twinkle.utils.errors import UserError

    meta = DatasetMeta(str(asset_path("olympiad_bench_tiny.jsonl")))
    dataset = LazyDataset(meta)
    dataset.map(OlympiadBenchProcessor(language="en"), dataset_meta=meta)
    sampler = TorchSampler(str(tiny_model_dir))
    sampler.set_template("Template", model_id=str(tiny_model_dir))
    assert sampler.sample([dataset[0]], SamplingParams(max_tokens=2))[0].sequences[0].tokens
    with pytest.raises(
        UserError, match=r"input row 1: messages\[1\] has images, but Template reads text only"
    ) as info:
        sampler.sample([dataset[0], dataset[3]], SamplingParams(max_tokens=2))
    assert "\n" not in str(info.value)
    parts = [
        {"type": "image", "url": dataset[3]["messages"][1]["images"][0]},
        {"type": "text", "text": "Read it."},
    ]
    with pytest.raises(
        UserError, match=r"input row 0: messages\[0\] has images, but Template reads text only"
    ):
        sampler.sample([{"messages": [{"role": "user", "content": parts}]}], SamplingParams(max_tokens=2))


def test_upstreams_content_parts_sample_as_tagged_images(tmp_path):
    """Upstream's OlympiadBench rows give the user turn as parts (``{'type': 'image', 'url': ...}``
    then text): they sample as the same turn written with an ``<image>`` tag and ``images``."""
    import torch
    from tiny_qwen3_5_vl import MODEL_CLS, build_tiny_qwen3_5_vl
    from tiny_qwen3_vl import picture

    from twinkle.data_format import SamplingParams
    from twinkle.sampler import TorchSampler
    from twinkle.template.images import BadImage

    folder = str(build_tiny_qwen3_5_vl(tmp_path / "q35", scale=6.0))
    sampler = TorchSampler(folder, model_cls=MODEL_CLS, dtype=torch.float32)
    sampler.set_template("Qwen3_5Template", model_id=folder, enable_thinking=False)
    image = picture((64, 64), (200, 30, 30))
    system = {"role": "system", "content": "Solve it."}
    parts = [{"type": "image", "url": image}, {"type": "text", "text": "What is shown?"}]
    upstream = {"messages": [system, {"role": "user", "content": parts}]}
    ours = {"messages": [system, {"role": "user", "content": "<image>What is shown?", "images": [image]}]}
    greedy = SamplingParams(max_tokens=6, temperature=0)
    a, b = (sampler.sample([p], greedy)[0] for p in (upstream, ours))
    assert a.prompt_token_ids == b.prompt_token_ids and a.sequences[0].tokens == b.sequences[0].tokens
    assert "pixel_values" in a.sequences[0].new_input_feature
    bad = {"messages": [{"role": "user", "content": [{"type": "audio", "audio": b""}]}]}
    with pytest.raises(
        BadImage, match=r"messages\[0\]\.content\[0\] has type 'audio'; content parts are"
    ) as info:
        sampler.sample([bad], greedy)
    assert "\n" not in str(info.value)
