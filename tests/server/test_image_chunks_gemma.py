"""Tinker's ``ImageChunk`` through the official SDK on servers of tiny Gemma 3 and Gemma 4 bases
(``tiny_gemma_vl.py``, sharpened so greedy choices win by clear margins): a forward_backward
with image chunks gives the in-process model's loss and adapter update, a greedy sample with an
image equals the in-process ``TorchSampler``'s token for token with the same log-probs, and
another picture behind the same tokens changes them; a declared token count that is not the
processor's, and processed images sent in ``loss_fn_inputs`` (a Gemma row has no grid sizes to
check them by), are one line each.

Tolerances as ``test_image_chunks_qwen3_vl``: training sums the same fp32 terms in other orders
(1e-5 relative on the loss, 1e-5 absolute on the adapter after Adam steps); sampling compares
log-probs with ``chain_tolerances`` of the language model's and the vision tower's sums."""

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

from tiny_gemma_vl import BUILDERS, TEMPLATES  # noqa: E402
from tiny_qwen3_vl import picture  # noqa: E402

CLASSES = {"gemma3": "Gemma3ForConditionalGeneration", "gemma4": "Gemma4ForConditionalGeneration"}
RED, BLUE = (200, 30, 30), (30, 30, 200)
CONVERSATIONS = [  # (question, answer, image size, colour)
    ("What colour?", "red", (32, 32), RED),
    ("Which shape?", "a wide one", (48, 32), BLUE),
]


@pytest.fixture(scope="module", params=["gemma3", "gemma4"])
def family(request, tmp_path_factory):
    """``(model_type, folder)``: the family's tiny checkpoint with its language model's matrices
    scaled by 8 and Gemma 4's image projection by 30 (as ``test_gemma_sampling`` sharpens them)."""
    import transformers

    model_type = request.param
    out = tmp_path_factory.mktemp(model_type)
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
    return model_type, sharp


@pytest.fixture(scope="module")
def served(family, tmp_path_factory):
    torch.manual_seed(0)
    running = start(family[1], tmp_path_factory.mktemp("srv"))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def template(family):
    from twinkle.template import get_template

    return get_template(TEMPLATES[family[0]], model_id=str(family[1]))


def encoded(template, question, answer, size, colour) -> tuple[dict, bytes]:
    image = picture(size, colour)
    messages = [
        {"role": "user", "content": "<image>" + question, "images": [image]},
        {"role": "assistant", "content": answer},
    ]
    return template.encode(messages), image


def local_steps(model_type, folder, adapter: str, rows: list[dict], steps: int) -> tuple[dict, list[float]]:
    """The same steps in process (``test_image_chunks.local_steps`` on the Gemma class)."""
    from twinkle.loss.token_weighted_ce import TokenWeightedCrossEntropyLoss
    from twinkle.model import MultiLoraTransformersModel
    from twinkle.model.forward import causal_lm_of
    from twinkle.processor.collate import collate
    from twinkle.server.datums import lora_config

    model = MultiLoraTransformersModel(str(folder), max_loras=2, max_r=8, model_cls=CLASSES[model_type])
    model.add_adapter_to_model(adapter, lora_config(4, causal_lm_of(model.model)))
    model.set_loss(TokenWeightedCrossEntropyLoss(reduction="sum"), adapter_name=adapter)
    model.set_optimizer("AdamW", lr=LR, adapter_name=adapter, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
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


def test_image_chunks_train_as_the_in_process_model(served, family, template):
    model_type, folder = family
    encoded_rows = [encoded(template, *c) for c in CONVERSATIONS]
    data = [chunked(row, image, template.image_token_id) for row, image in encoded_rows]
    client = tinker.ServiceClient(base_url=served.url, api_key=KEY_A)
    tc = client.create_lora_training_client(base_model=str(folder), rank=4, train_unembed=False).result()
    losses = []
    for _ in range(2):
        out = tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=LR)).result()
        losses.append(out.metrics["loss:sum"])
    assert [len(o["logprobs"].tolist()) for o in out.loss_fn_outputs] == [
        len(row["input_ids"]) - 1 for row, _ in encoded_rows
    ]
    s = served.app.state.server
    name = s.registry.runs[tc.model_id].adapter
    state = s.engine.core.adapter_state(name)
    assert state and not [k for k in state if "vision" in k]  # LoRA on the language model only
    expected_state, expected_losses = local_steps(model_type, folder, name, [r for r, _ in encoded_rows], 2)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert losses[1] < losses[0]
    assert state.keys() == expected_state.keys()
    for k, v in expected_state.items():
        torch.testing.assert_close(state[k], v, atol=1e-5, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


def test_a_wrong_count_and_sent_pixels_are_one_line(served, family, template):
    _, folder = family
    row, image = encoded(template, *CONVERSATIONS[0])
    count = list(row["input_ids"]).count(template.image_token_id)
    client = tinker.ServiceClient(base_url=served.url, api_key=KEY_A)
    tc = client.create_lora_training_client(base_model=str(folder), rank=4, train_unembed=False).result()
    with pytest.raises(
        Exception, match=rf"datum 0: image 0 is {count} tokens .*expected_tokens={count + 1}"
    ) as info:
        tc.forward_backward(
            [chunked(row, image, template.image_token_id, expected=count + 1)], "cross_entropy"
        ).result()
    assert "\n" not in str(info.value).strip()
    ids = list(row["input_ids"])
    sent = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.asarray(ids[1:], dtype=np.int64)),
            "weights": types.TensorData.from_numpy(np.ones(len(ids) - 1, dtype=np.float32)),
            "pixel_values": types.TensorData.from_numpy(np.asarray(row["pixel_values"], dtype=np.float32)),
        },
    )
    with pytest.raises(Exception, match="datum 0: .*send each image as an ImageChunk"):
        tc.forward_backward([sent], "cross_entropy").result()


def prompt_of(template, colour) -> tuple[dict, types.ModelInput]:
    image = picture((32, 32), colour)
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


def test_greedy_with_an_image_equals_the_in_process_sampler(served, family, template):
    from twinkle.data_format import SamplingParams
    from twinkle.sampler import TorchSampler

    model_type, folder = family
    local = TorchSampler(str(folder), model_cls=CLASSES[model_type], dtype=torch.float32)
    client = tinker.ServiceClient(base_url=served.url, api_key=KEY_A)
    sampler = client.create_sampling_client(base_model=str(folder)).result()
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    seen = {}
    for colour in (RED, BLUE):
        row, prompt = prompt_of(template, colour)
        out = sampler.sample(prompt, 1, greedy).result()
        keys = ("input_ids", "pixel_values", "image_position_ids")
        (mine,) = local.sample(
            {k: row[k] for k in keys if k in row}, SamplingParams(max_tokens=8, temperature=0)
        )
        seq, expected = out.sequences[0], mine.sequences[0]
        assert list(seq.tokens) == expected.tokens and len(set(seq.tokens)) > 2
        want = torch.tensor([entry[0][1] for entry in expected.logprobs])
        got = torch.tensor(list(seq.logprobs))
        pixels = torch.as_tensor(row["pixel_values"])
        patches = pixels.shape[1] if pixels.dim() == 3 else (pixels.shape[-1] // 4) ** 2
        sums = llama_sums(
            32, 64, 2, tokens=len(row["input_ids"]) + len(seq.tokens), vocab=len(template.tokenizer)
        )
        sums += llama_sums(32, 64, 1, tokens=patches) + [48, 32]  # the vision tower and projection
        torch.testing.assert_close(got, want, **chain_tolerances(sums, want))
        seen[colour] = list(seq.tokens)
    assert seen[RED] != seen[BLUE]  # the picture behind the same tokens is seen


def test_a_text_prompt_samples_as_the_in_process_sampler(served, family, template):
    """A text prompt on a Gemma base runs the sampler's own decoding (the shared decoding batch
    does not lay out sliding-window layers): the in-process sampler's tokens."""
    from twinkle.data_format import SamplingParams
    from twinkle.sampler import TorchSampler

    model_type, folder = family
    ids = template.encode([{"role": "user", "content": "Say hello."}], add_generation_prompt=True)[
        "input_ids"
    ]
    client = tinker.ServiceClient(base_url=served.url, api_key=KEY_A)
    sampler = client.create_sampling_client(base_model=str(folder)).result()
    out = sampler.sample(
        types.ModelInput.from_ints(list(ids)), 1, types.SamplingParams(max_tokens=6, temperature=0.0)
    ).result()
    local = TorchSampler(str(folder), model_cls=CLASSES[model_type], dtype=torch.float32)
    (mine,) = local.sample({"input_ids": list(ids)}, SamplingParams(max_tokens=6, temperature=0))
    assert list(out.sequences[0].tokens) == mine.sequences[0].tokens


def test_twinkle_client_places_a_gemma_bases_images_with_its_template(family):
    """``twinkle_client`` builds a Gemma prompt's image chunks with the family's template
    (``test_client_image_gemma`` samples and trains through it)."""
    from twinkle_client.image_prompts import served_template

    model_type, folder = family
    assert type(served_template(str(folder))).__name__ == TEMPLATES[model_type]
