"""``twinkle_client`` with images on servers without keys of tiny Gemma 3 and Gemma 4 bases
(``tiny_gemma_vl.py``, sharpened so greedy choices win by clear margins). A Gemma row carries no
grid sizes, so the client sends each of its images as an ``ImageChunk`` rebuilt from its
``pixel_values`` (Gemma 4: with its ``image_position_ids``): an encoded row and a trajectory
sample greedily what the in-process ``TorchSampler`` samples (tokens, and log-probs within fp32's
bounds), another picture behind the same tokens samples otherwise, and training steps on encoded
rows give the in-process model's losses and adapter (trajectories the client encodes score as
their rows). A picture far from square samples on Gemma 3 (resized to its square); a Gemma 4
row of one is one line (its rebuilt picture the processor would resize again).

Tolerances as ``test_image_chunks_gemma``: the server sums the same fp32 terms in other orders
(1e-5 relative on the losses, 1e-5 absolute on the adapter after Adam steps; log-probs within
``chain_tolerances`` of the language model's and the vision tower's sums)."""

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from serving import Running, free_port
from test_image_chunks import LR
from test_image_chunks_gemma import CLASSES, CONVERSATIONS, encoded, local_steps
from tolerances import chain_tolerances, llama_sums

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "assets"))

from tiny_gemma_vl import BUILDERS, TEMPLATES  # noqa: E402
from tiny_qwen3_vl import picture  # noqa: E402

RED, BLUE = (200, 30, 30), (30, 30, 200)
GREEDY = {"max_tokens": 8, "temperature": 0.0}


def sharp_checkpoint(model_type: str, out: Path) -> Path:
    """The family's tiny checkpoint with its language model's matrices scaled by 8 and Gemma 4's
    image projection by 30, so that greedy choices are not near ties."""
    import transformers

    plain = BUILDERS[model_type](out / "plain")
    model = getattr(transformers, CLASSES[model_type]).from_pretrained(str(plain), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "vision" not in name and "embed" not in name:
                p.mul_(8)
            if "embed_vision.embedding_projection" in name:
                p.mul_(30)
    sharp = out / "sharp"
    model.save_pretrained(sharp)
    for f in plain.iterdir():
        if f.suffix in (".json", ".jinja", ".txt") and not (sharp / f.name).exists():
            shutil.copy(f, sharp / f.name)
    return sharp


@pytest.fixture(scope="module", params=["gemma3", "gemma4"])
def family(request, tmp_path_factory):
    return request.param, sharp_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def served(family, tmp_path_factory):
    import twinkle
    from twinkle.server import ServerConfig, create_app
    from twinkle.server.config import keyless_keys
    from twinkle.server.state import Limits

    torch.manual_seed(0)
    config = ServerConfig(
        model_id=str(family[1]),
        max_loras=2,
        max_r=16,
        output_dir=tmp_path_factory.mktemp("srv"),
        keys=keyless_keys("127.0.0.1", Limits()),
        keyless=True,
    )
    running = Running(create_app(config), free_port())
    twinkle.init_twinkle_client(base_url=running.url, api_key="EMPTY_TOKEN")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def template(family):
    from twinkle.template import get_template

    return get_template(TEMPLATES[family[0]], model_id=str(family[1]))


@pytest.fixture(scope="module")
def local(family):
    from twinkle.sampler import TorchSampler

    return TorchSampler(str(family[1]), model_cls=CLASSES[family[0]], dtype=torch.float32)


def conversation(question, answer, size, colour) -> dict:
    image = picture(size, colour)
    user = {"role": "user", "content": "<image>" + question, "images": [image]}
    return {"messages": [user, {"role": "assistant", "content": answer}]}


def trajectory(image: bytes) -> dict:
    return {"messages": [{"role": "user", "content": "<image>What colour?", "images": [image]}]}


def expected(local, row: dict) -> tuple[list[int], torch.Tensor]:
    from twinkle.data_format import SamplingParams

    keys = ("input_ids", "pixel_values", "image_position_ids")
    (out,) = local.sample({k: row[k] for k in keys if k in row}, SamplingParams(**GREEDY))
    seq = out.sequences[0]
    return seq.tokens, torch.tensor([entry[0][1] for entry in seq.logprobs])


def assert_same(tokens, logps, want_tokens, want_logps, row, template) -> None:
    assert list(tokens) == want_tokens and len(set(want_tokens)) > 2
    got = torch.tensor([float(lp) for lp in logps])
    pixels = torch.as_tensor(row["pixel_values"])
    patches = pixels.shape[1] if pixels.dim() == 3 else (pixels.shape[-1] // 4) ** 2
    vocab = len(template.tokenizer)
    sums = llama_sums(32, 64, 2, tokens=len(row["input_ids"]) + len(want_tokens), vocab=vocab)
    sums += llama_sums(32, 64, 1, tokens=patches) + [48, 32]  # the vision tower and projection
    torch.testing.assert_close(got, want_logps, **chain_tolerances(sums, want_logps))


def test_an_encoded_row_and_a_trajectory_sample_as_the_in_process_sampler(served, family, template, local):
    from twinkle_client.sampler import Sampler, vLLMSampler

    sampler = vLLMSampler()
    seen = {}
    for colour, size in ((RED, (32, 32)), (BLUE, (32, 32)), (RED, (50, 37))):
        row = template.encode(trajectory(picture(size, colour)), add_generation_prompt=True)
        want_tokens, want_logps = expected(local, row)
        (response,) = sampler.sample(row, GREEDY)
        seq = response.sequences[0]
        assert_same(seq.tokens, [pair[0][1] for pair in seq.logprobs], want_tokens, want_logps, row, template)
        feature = seq.new_input_feature  # the row's own images, ready to train on
        assert feature["input_ids"] == list(row["input_ids"]) + want_tokens
        for k in ("pixel_values", "image_position_ids"):
            assert (k in feature) == (k in row)
            if k in row:
                assert np.array_equal(np.asarray(feature[k]), np.asarray(row[k]))
        seen[colour, size] = want_tokens
    assert seen[RED, (32, 32)] != seen[BLUE, (32, 32)]  # another picture behind the same tokens

    traj = trajectory(picture((48, 32), BLUE))
    row = template.encode(traj, add_generation_prompt=True)
    want_tokens, want_logps = expected(local, row)
    sampler.set_template(TEMPLATES[family[0]])
    (response,) = sampler.sample([traj], GREEDY)
    seq = response.sequences[0]
    assert_same(seq.tokens, [pair[0][1] for pair in seq.logprobs], want_tokens, want_logps, row, template)
    (plain,) = Sampler().sample(row, max_tokens=8, temperature=0.0)  # the plain sampler takes the row
    assert_same(plain["tokens"], plain["logprobs"], want_tokens, want_logps, row, template)


def test_training_rows_train_as_the_in_process_model(served, family, template):
    from twinkle_client.model import MultiLoraTransformersModel

    model_type, folder = family
    rows = [encoded(template, *c)[0] for c in CONVERSATIONS]
    model = MultiLoraTransformersModel()
    model.add_adapter_to_model("mine", {"r": 4})
    model.set_optimizer("AdamW", lr=LR, adapter_name="mine", betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    losses = []
    for _ in range(2):
        losses.append(float(model.forward_backward(rows, adapter_name="mine")))
        assert model.clip_grad_and_step(0.0, adapter_name="mine")
    s = served.app.state.server
    name = s.registry.runs[model.runs["mine"].model_id].adapter
    state = s.engine.core.adapter_state(name)
    expected_state, expected_sums = local_steps(model_type, folder, name, rows, 2)
    trained = sum(int((torch.as_tensor(r["labels"])[1:] != -100).sum()) for r in rows)
    np.testing.assert_allclose(losses, np.array(expected_sums) / trained, rtol=1e-5)
    assert losses[1] < losses[0]
    assert state.keys() == expected_state.keys() and not [k for k in state if "vision" in k]
    for k, v in expected_state.items():
        torch.testing.assert_close(state[k], v, atol=1e-5, rtol=0, msg=lambda m, k=k: f"{k}: {m}")

    # the same conversations as trajectories, encoded by the client: their own pictures are sent
    model.set_template(TEMPLATES[model_type], adapter_name="mine")
    as_rows = model.forward_only(rows, adapter_name="mine").result["logps"]
    as_trajectories = model.forward_only([conversation(*c) for c in CONVERSATIONS], adapter_name="mine")
    torch.testing.assert_close(as_trajectories.result["logps"], as_rows, atol=1e-6, rtol=0)
    # a picture far from square, which no rebuilt picture could stand for on Gemma 4, goes as it is
    wide = model.forward_only(conversation("What colour?", "red", (100, 20), RED), adapter_name="mine")
    assert np.isfinite(wide.result["loss"]) and wide.result["num_tokens"] > 0


def test_a_picture_far_from_square(served, family, template, local):
    """Gemma 3 resizes every picture to one square, which the rebuilt picture keeps; Gemma 4
    resizes a 5:1 picture to a patch grid that, rebuilt, its processor would resize to another:
    no picture sent as a chunk gives the row's pixels, so the row is refused in one line."""
    from twinkle_client.sampler import vLLMSampler

    row = template.encode(trajectory(picture((100, 20), RED)), add_generation_prompt=True)
    if family[0] == "gemma3":
        want_tokens, want_logps = expected(local, row)
        seq = vLLMSampler().sample(row, GREEDY)[0].sequences[0]
        assert_same(seq.tokens, [pair[0][1] for pair in seq.logprobs], want_tokens, want_logps, row, template)
        return
    with pytest.raises(ValueError, match="row 0: its pictures cannot be rebuilt") as caught:
        vLLMSampler().sample(row, GREEDY)
    assert "\n" not in str(caught.value) and "Message.images" in str(caught.value)
