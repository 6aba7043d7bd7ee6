"""Tinker's ``ImageChunk`` through the official SDK on a server of a tiny Qwen3.5 base with its
image processor (``tiny_qwen3_5_vl.py``: a linear-attention layer then a full-attention one,
Qwen3-VL's 16-pixel patches), its matrices scaled so greedy choices win by clear margins: a
forward_backward with image chunks gives the in-process model's loss and adapter update, and a
greedy sample with an image equals the in-process ``TorchSampler``'s token for token with the
same log-probs, another picture changing them. The same checkpoint without its image processor
serves text, and an image sent to it is one line.

Tolerances as ``test_image_chunks_qwen3_vl``. Adam runs with ``eps=1`` here (``EPS``): the
linear-attention layer's decay-gate LoRA has gradients of one head near 1e-5 of the largest, within
what other fp32 orders of the gated delta rule move, and Adam's first step at a tiny ``eps`` turns
every gradient into plus or minus the learning rate, whatever its size; at ``eps=1`` the update
follows the gradient, so the two runs' adapters agree to fp32's orders."""

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from serving import KEY_A, start
from test_image_chunks import IGNORE, LR, chunked
from tinker import types
from tolerances import chain_tolerances, llama_sums

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "assets"))

from tiny_qwen3_5_vl import MODEL_CLS, build_tiny_qwen3_5_vl  # noqa: E402
from tiny_qwen3_vl import picture  # noqa: E402

RED, BLUE = (200, 30, 30), (30, 30, 200)
EPS = 1.0
CONVERSATIONS = [  # (question, answer, image size, colour): 4 and 6 visual tokens
    ("What colour?", "red", (64, 64), RED),
    ("Which shape?", "a wide one", (96, 64), BLUE),
]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return build_tiny_qwen3_5_vl(tmp_path_factory.mktemp("qwen3-5"), scale=6.0)


@pytest.fixture(scope="module")
def vl_server(vl_dir, tmp_path_factory):
    torch.manual_seed(0)
    running = start(vl_dir, tmp_path_factory.mktemp("srv"))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def template(vl_dir):
    from twinkle.template import get_template

    return get_template("Qwen3VLTemplate", model_id=str(vl_dir))


def encoded(template, question, answer, size, colour) -> tuple[dict, bytes]:
    image = picture(size, colour)
    messages = [
        {"role": "user", "content": "<image>" + question, "images": [image]},
        {"role": "assistant", "content": answer},
    ]
    return template.encode(messages), image


def local_steps(vl_dir, adapter: str, rows: list[dict], steps: int) -> tuple[dict, list[float]]:
    """The same steps in process (``test_image_chunks.local_steps`` on the Qwen3.5 class)."""
    from twinkle.loss.token_weighted_ce import TokenWeightedCrossEntropyLoss
    from twinkle.model import MultiLoraTransformersModel
    from twinkle.model.forward import causal_lm_of
    from twinkle.processor.collate import collate
    from twinkle.server.datums import lora_config

    model = MultiLoraTransformersModel(str(vl_dir), max_loras=2, max_r=8, model_cls=MODEL_CLS)
    model.add_adapter_to_model(adapter, lora_config(4, causal_lm_of(model.model)))
    model.set_loss(TokenWeightedCrossEntropyLoss(reduction="sum"), adapter_name=adapter)
    model.set_optimizer("AdamW", lr=LR, adapter_name=adapter, betas=(0.9, 0.95), eps=EPS, weight_decay=0.0)
    batch = collate(rows, pad_token_id=0)
    trained = (batch["labels"] != IGNORE).float()
    losses = []
    for _ in range(steps):
        losses.append(
            float(model.forward_backward(batch, adapter_name=adapter, loss_weights=trained * trained.sum()))
        )
        model.clip_grad_norm(0.0, adapter_name=adapter)
        model.step(adapter_name=adapter)
        model.zero_grad(adapter_name=adapter)
    return model.slots.export(adapter), losses


def test_image_chunks_train_as_the_in_process_model(vl_server, vl_dir, template):
    encoded_rows = [encoded(template, *c) for c in CONVERSATIONS]
    assert [template.image_tokens(row["image_grid_thw"][0]) for row, _ in encoded_rows] == [4, 6]
    data = [chunked(row, image, template.image_token_id) for row, image in encoded_rows]
    client = tinker.ServiceClient(base_url=vl_server.url, api_key=KEY_A)
    tc = client.create_lora_training_client(base_model=str(vl_dir), rank=4, train_unembed=False).result()
    losses = []
    for _ in range(2):
        out = tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=LR, eps=EPS)).result()
        losses.append(out.metrics["loss:sum"])
    s = vl_server.app.state.server
    name = s.registry.runs[tc.model_id].adapter
    state = s.engine.core.adapter_state(name)
    assert state and not [k for k in state if ".visual." in k]  # LoRA on the language model only
    expected_state, expected_losses = local_steps(vl_dir, name, [row for row, _ in encoded_rows], 2)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert losses[1] < losses[0]
    assert state.keys() == expected_state.keys()
    for k, v in expected_state.items():
        torch.testing.assert_close(state[k], v, atol=1e-5, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


def prompt_of(template, colour) -> tuple[dict, types.ModelInput]:
    image = picture((64, 64), colour)
    row = template.encode(
        [{"role": "user", "content": "<image>What colour?", "images": [image]}], add_generation_prompt=True
    )
    ids = list(row["input_ids"])
    first, count = ids.index(template.image_token_id), ids.count(template.image_token_id)
    chunks = [
        types.EncodedTextChunk(tokens=ids[:first]),
        types.ImageChunk(data=image, format="png", expected_tokens=count),
        types.EncodedTextChunk(tokens=ids[first + count :]),
    ]
    return row, types.ModelInput(chunks=chunks)


def test_greedy_with_an_image_equals_the_in_process_sampler(vl_server, vl_dir, template):
    from twinkle.data_format import SamplingParams
    from twinkle.sampler import TorchSampler

    local = TorchSampler(str(vl_dir), model_cls=MODEL_CLS, dtype=torch.float32)
    client = tinker.ServiceClient(base_url=vl_server.url, api_key=KEY_A)
    sampler = client.create_sampling_client(base_model=str(vl_dir)).result()
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    seen = {}
    for colour in (RED, BLUE):
        row, prompt = prompt_of(template, colour)
        out = sampler.sample(prompt, 1, greedy).result()
        (mine,) = local.sample(
            {k: row[k] for k in ("input_ids", "pixel_values", "image_grid_thw")},
            SamplingParams(max_tokens=8, temperature=0),
        )
        seq, expected = out.sequences[0], mine.sequences[0]
        assert list(seq.tokens) == expected.tokens and len(set(seq.tokens)) > 2
        want = torch.tensor([entry[0][1] for entry in expected.logprobs])
        got = torch.tensor(list(seq.logprobs))
        sums = llama_sums(
            32, 64, 2, tokens=len(row["input_ids"]) + len(seq.tokens), vocab=len(template.tokenizer)
        )
        sums += llama_sums(32, 64, 2, tokens=len(row["pixel_values"]))  # the vision tower's blocks
        torch.testing.assert_close(got, want, **chain_tolerances(sums, want))
        seen[colour] = list(seq.tokens)
    assert seen[RED] != seen[BLUE]  # the picture behind the same tokens is seen


def test_without_its_image_processor_a_qwen3_5_base_serves_text(vl_dir, template, tmp_path):
    text_only = tmp_path / "no-processor"
    shutil.copytree(vl_dir, text_only)
    (text_only / "preprocessor_config.json").unlink()
    running = start(text_only, tmp_path / "srv")
    try:
        client = tinker.ServiceClient(base_url=running.url, api_key=KEY_A)
        sampler = client.create_sampling_client(base_model=str(text_only)).result()
        _, prompt = prompt_of(template, RED)
        with pytest.raises(Exception, match="prompt: images are placed for .* the served model is qwen3_5"):
            sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()
        text = types.ModelInput.from_ints(template.tokenizer("Say hello.")["input_ids"])
        out = sampler.sample(text, 1, types.SamplingParams(max_tokens=3)).result()
        assert 1 <= len(out.sequences[0].tokens) <= 3
    finally:
        running.stop()
