"""``twinkle_client``'s samplers with images, against a server without keys on a tiny Qwen2.5-VL
whose greedy choices win by clear margins (``vl_sampling_helpers.build_sharp_vl``): a row a
vision-language template encoded (its pictures rebuilt from its ``pixel_values``) and a trajectory
with ``Message.images`` both sample greedily what the in-process ``TorchSampler`` samples on the
same row (tokens, and log-probs within fp32's bounds); another picture behind the same tokens
samples otherwise; rows whose images do not match their tokens are one line.

Tolerances: the server's model and the in-process sampler run the same fp32 sums in orders that
may differ, so their log-probs agree within ``tolerances.chain_tolerances`` of the language
model's sums and the vision tower's."""

import io
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from serving import Running, free_port
from tolerances import chain_tolerances, llama_sums

for folder in ("sampler", "multimodal"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / folder))

from vl_pictures import png_bytes  # noqa: E402
from vl_sampling_helpers import VL_CLASS, build_sharp_vl  # noqa: E402  (after the folders are on the path)

RED, BLUE = (200, 30, 30), (30, 30, 200)
GREEDY = {"max_tokens": 8, "temperature": 0.0}


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return build_sharp_vl(tmp_path_factory.mktemp("sharp-vl"))


@pytest.fixture(scope="module")
def client(vl_dir, tmp_path_factory):
    import twinkle
    from twinkle.server import ServerConfig, create_app
    from twinkle.server.config import keyless_keys
    from twinkle.server.state import Limits

    torch.manual_seed(0)
    config = ServerConfig(
        model_id=str(vl_dir),
        max_loras=2,
        max_r=16,
        output_dir=tmp_path_factory.mktemp("srv"),
        keys=keyless_keys("127.0.0.1", Limits()),
        keyless=True,
    )
    running = Running(create_app(config), free_port())
    yield twinkle.init_twinkle_client(base_url=running.url, api_key="EMPTY_TOKEN")
    running.stop()


@pytest.fixture(scope="module")
def template(vl_dir):
    from twinkle.template import get_template

    return get_template("Qwen2_5VLTemplate", model_id=str(vl_dir))


@pytest.fixture(scope="module")
def local(vl_dir):
    from twinkle.sampler import TorchSampler

    return TorchSampler(str(vl_dir), model_cls=VL_CLASS, dtype=torch.float32)


def noise_png(size: tuple[int, int], seed: int = 0) -> bytes:
    """A PNG of random pixels of ``size`` (width, height): a picture whose rebuilding from its
    patches must put every pixel back where it was (a plain colour would hide a swapped axis)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG")
    return out.getvalue()


def trajectory(picture: bytes) -> dict:
    return {"messages": [{"role": "user", "content": "<image>What colour?", "images": [picture]}]}


def expected(local, row: dict) -> tuple[list[int], torch.Tensor]:
    from twinkle.data_format import SamplingParams

    (out,) = local.sample(
        {k: row[k] for k in ("input_ids", "pixel_values", "image_grid_thw")},
        SamplingParams(max_tokens=8, temperature=0),
    )
    seq = out.sequences[0]
    return seq.tokens, torch.tensor([entry[0][1] for entry in seq.logprobs])


def assert_same(seq_tokens, seq_logps, want_tokens, want_logps, row) -> None:
    assert list(seq_tokens) == want_tokens and len(set(want_tokens)) > 2
    got = torch.tensor([float(lp) for lp in seq_logps])
    sums = llama_sums(32, 64, 2, tokens=len(row["input_ids"]) + len(want_tokens), vocab=700)
    sums += llama_sums(32, 64, 1, tokens=len(row["pixel_values"]))
    torch.testing.assert_close(got, want_logps, **chain_tolerances(sums, want_logps))


def test_an_encoded_row_samples_as_the_in_process_sampler(client, template, local):
    from twinkle_client.sampler import vLLMSampler

    sampler = vLLMSampler()
    seen = {}
    # plain colours, and random pixels the processor resizes to its grid (50x37 is no multiple of it)
    pictures = {
        "red": png_bytes((32, 32), RED),
        "blue": png_bytes((32, 32), BLUE),
        "noise": noise_png((50, 37)),
    }
    for name, picture in pictures.items():
        row = template.encode(trajectory(picture), add_generation_prompt=True)
        want_tokens, want_logps = expected(local, row)
        as_lists = {k: v.tolist() if hasattr(v, "tolist") else v for k, v in row.items()}
        for given in (row, as_lists):  # tensors, or lists as upstream's client scripts send rows
            (response,) = sampler.sample(given, GREEDY)
            seq = response.sequences[0]
            assert_same(seq.tokens, [pair[0][1] for pair in seq.logprobs], want_tokens, want_logps, row)
            feature = seq.new_input_feature
            assert feature["input_ids"] == list(row["input_ids"]) + want_tokens
            assert np.array_equal(np.asarray(feature["image_grid_thw"]), row["image_grid_thw"].numpy())
            assert np.array_equal(np.asarray(feature["pixel_values"]), row["pixel_values"].numpy())
        seen[name] = want_tokens
    assert seen["red"] != seen["blue"]  # the same tokens, another picture: another greedy completion


def test_a_trajectory_with_images_samples_as_the_in_process_sampler(client, template, local):
    from twinkle_client.sampler import Sampler, vLLMSampler

    sampler = vLLMSampler()
    sampler.set_template("Qwen2_5VLTemplate")
    traj = trajectory(noise_png((48, 32), seed=1))
    row = template.encode(traj, add_generation_prompt=True)
    want_tokens, want_logps = expected(local, row)
    (response,) = sampler.sample([traj], GREEDY)
    seq = response.sequences[0]
    assert_same(seq.tokens, [pair[0][1] for pair in seq.logprobs], want_tokens, want_logps, row)
    assert seq.decoded == template.decode(want_tokens)
    assert seq.new_input_feature["messages"] == traj["messages"]
    # twinkle_client's Sampler takes the encoded row itself
    (plain,) = Sampler().sample(row, max_tokens=8, temperature=0.0)
    assert_same(plain["tokens"], plain["logprobs"], want_tokens, want_logps, row)


def test_rows_whose_images_do_not_match_are_one_line(client, template):
    from twinkle_client.sampler import vLLMSampler

    sampler = vLLMSampler()
    row = dict(template.encode(trajectory(noise_png((40, 40))), add_generation_prompt=True))
    ids = list(row["input_ids"])
    cases = {
        "without the other of pixel_values, image_grid_thw": {**row, "image_grid_thw": None},
        # pixel_values no processor makes of an 8-bit picture (a fraction of one level off)
        "image_grid_thw covers": {**row, "image_grid_thw": row["image_grid_thw"] * torch.tensor([1, 2, 1])},
        "cannot be rebuilt from its pixel_values": {**row, "pixel_values": row["pixel_values"] + 3e-3},
        "do not hold image 0's": {**row, "input_ids": [t for t in ids if t != template.image_token_id]},
        "beyond its 1 image(s)": {**row, "input_ids": ids + [template.image_token_id]},
    }
    for words, bad in cases.items():
        with pytest.raises(ValueError, match="row 0") as caught:
            sampler.sample(bad, GREEDY)
        assert words in str(caught.value) and "\n" not in str(caught.value)


def test_a_served_model_whose_images_the_server_does_not_place_is_one_line(
    tmp_path, tiny_model_dir, monkeypatch
):
    from tiny_qwen3_vl import build_tiny_qwen3_vl

    from twinkle.server import images
    from twinkle.template import Qwen3VLTemplate
    from twinkle.utils.errors import UserError
    from twinkle_client.image_prompts import served_template

    assert served_template(str(tiny_model_dir)) is None  # a text model: no image path
    qwen3_vl = build_tiny_qwen3_vl(tmp_path / "qwen3-vl")
    assert isinstance(served_template(str(qwen3_vl)), Qwen3VLTemplate)
    # a vision-language family the server has no template for: one line naming the ones it has
    monkeypatch.delitem(images.TEMPLATES, "qwen3_vl")
    with pytest.raises(
        UserError,
        match="the served model is qwen3_vl; the server places images for gemma3, gemma4, qwen2_5_vl, ",
    ):
        served_template(str(qwen3_vl))
