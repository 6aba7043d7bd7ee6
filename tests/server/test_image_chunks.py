"""Tinker's ``ImageChunk`` through the official SDK on a server of a tiny Qwen2.5-VL: a
forward_backward with image chunks gives the in-process model's loss and adapter update on the
same images and text; the same rows sent as upstream's ``input_feature_to_datum`` sends them
(processed images in ``loss_fn_inputs``) give the same log-probabilities; a bad image is one
line naming the datum.

Tolerances as ``test_client_scripts``: the server and the in-process model sum the same fp32
terms in orders that may differ (padding, the loss chained through ``-sum(w * logp)``), a
random-walk bound of ``sqrt(n) * eps ~ 1e-5`` relative for ``n`` up to the tokens times the
hidden size; the adapter after Adam steps of ``lr = 1e-2`` to 1e-5 absolute."""

import sys
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from serving import KEY_A, start
from tinker import types

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multimodal"))

from tiny_vl import build_tiny_vl  # noqa: E402  (after the multimodal folder is on the path)
from vl_pictures import png_bytes  # noqa: E402

IGNORE = -100
LR = 1e-2
VL_CLS = "Qwen2_5_VLForConditionalGeneration"
CONVERSATIONS = [  # (question, answer, image size, colour)
    ("What colour?", "red", (32, 32), (200, 30, 30)),
    ("Which shape?", "a tall one", (32, 48), (30, 30, 200)),
]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return build_tiny_vl(tmp_path_factory.mktemp("tiny-vl"))


@pytest.fixture(scope="module")
def vl_server(vl_dir, tmp_path_factory):
    torch.manual_seed(0)
    running = start(vl_dir, tmp_path_factory.mktemp("srv"))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def template(vl_dir):
    from twinkle.template import get_template

    return get_template("Qwen2_5VLTemplate", model_id=str(vl_dir))


def encoded(template, question, answer, size, colour) -> tuple[dict, bytes]:
    picture = png_bytes(size, colour)
    messages = [
        {"role": "user", "content": "<image>" + question, "images": [picture]},
        {"role": "assistant", "content": answer},
    ]
    return template.encode(messages), picture


def chunked(row: dict, picture: bytes, image_id: int, expected: int | None = -1) -> types.Datum:
    """The shifted Tinker datum of an encoded row with its image as an ``ImageChunk`` in place
    of its placeholder tokens (``expected``: -1 declares the true count, None none)."""
    ids, labels = list(row["input_ids"]), list(row["labels"])
    inputs = ids[:-1]
    first = inputs.index(image_id)
    count = inputs.count(image_id)
    chunks = [
        types.EncodedTextChunk(tokens=inputs[:first]),
        types.ImageChunk(data=picture, format="png", expected_tokens=count if expected == -1 else expected),
        types.EncodedTextChunk(tokens=inputs[first + count :]),
    ]
    weights = [float(lab != IGNORE) for lab in labels[1:]]
    return types.Datum(
        model_input=types.ModelInput(chunks=chunks),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.asarray(ids[1:], dtype=np.int64)),
            "weights": types.TensorData.from_numpy(np.asarray(weights, dtype=np.float32)),
        },
    )


def trainer(server, base):
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    return client.create_lora_training_client(base_model=str(base), rank=4, train_unembed=False).result()


def local_steps(vl_dir, adapter: str, rows: list[dict], steps: int) -> tuple[dict, list[float]]:
    """The same steps in process: a multi-LoRA model of the VL class with the server's LoRA
    placement, the summed cross-entropy's gradient (``test_server.local_train``'s weights ``T``)."""
    from twinkle.loss.token_weighted_ce import TokenWeightedCrossEntropyLoss
    from twinkle.model import MultiLoraTransformersModel
    from twinkle.model.forward import causal_lm_of
    from twinkle.processor.collate import collate
    from twinkle.server.datums import lora_config

    model = MultiLoraTransformersModel(str(vl_dir), max_loras=2, max_r=8, model_cls=VL_CLS)
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


def test_image_chunks_train_as_the_in_process_model(vl_server, vl_dir, template):
    encoded_rows = [encoded(template, *c) for c in CONVERSATIONS]
    data = [chunked(row, picture, template.image_token_id) for row, picture in encoded_rows]
    tc = trainer(vl_server, vl_dir)
    losses = []
    for _ in range(2):
        out = tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=LR)).result()
        losses.append(out.metrics["loss:sum"])
    # one log-probability per position of the datum, its image's tokens included
    assert [len(o["logprobs"].tolist()) for o in out.loss_fn_outputs] == [
        len(row["input_ids"]) - 1 for row, _ in encoded_rows
    ]
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


def test_upstreams_datum_of_an_encoded_row_scores_as_its_image_chunks(vl_server, vl_dir, template):
    """``input_feature_to_datum`` sends the row's processed images in ``loss_fn_inputs``; the
    server reads them as it reads the chunks it processes itself."""
    from twinkle.server.common import input_feature_to_datum

    encoded_rows = [encoded(template, *c) for c in CONVERSATIONS]
    tc = trainer(vl_server, vl_dir)
    sent = [input_feature_to_datum(row) for row, _ in encoded_rows]
    chunks = [chunked(row, picture, template.image_token_id, expected=None) for row, picture in encoded_rows]
    a = tc.forward(sent, "cross_entropy").result()
    b = tc.forward(chunks, "cross_entropy").result()
    for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(x["logprobs"].tolist(), y["logprobs"].tolist(), atol=1e-6, rtol=0)
    assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-6)
    # the pictures are seen: another colour, the same text, another loss
    recoloured = [encoded(template, q, r, size, (0, 255, 0)) for q, r, size, _ in CONVERSATIONS]
    other = [chunked(row, picture, template.image_token_id) for row, picture in recoloured]
    c = tc.forward(other, "cross_entropy").result()
    assert abs(c.metrics["loss:sum"] - b.metrics["loss:sum"]) > 1e-4


def _refused(tc, data, pattern: str) -> str:
    with pytest.raises(Exception, match=pattern) as info:
        tc.forward_backward(data, "cross_entropy").result()
    text = str(info.value)
    assert "\n" not in text.strip(), text
    return text


def test_a_bad_image_is_one_line_naming_the_datum(vl_server, vl_dir, template):
    tc = trainer(vl_server, vl_dir)
    row, picture = encoded(template, *CONVERSATIONS[0])
    good = chunked(row, picture, template.image_token_id)
    n = template.image_tokens(row["image_grid_thw"][0])
    _refused(
        tc,
        [good, chunked(row, picture, template.image_token_id, expected=n + 1)],
        rf"datum 1: image 0 is {n} tokens for this model's image processor \(grid 1x8x8\), but its "
        rf"chunk declares expected_tokens={n + 1}",
    )
    _refused(
        tc,
        [chunked(row, b"not a png", template.image_token_id)],
        r"datum 0: image 0 \(9 bytes of png\) cannot be decoded",
    )
    ids = list(row["input_ids"])[:-1]
    first, count = ids.index(template.image_token_id), ids.count(template.image_token_id)
    before, after = ids[:first], ids[first + count :]
    targets, weights = good.loss_fn_inputs["target_tokens"].tolist(), good.loss_fn_inputs["weights"].tolist()

    def variant(before, image, after, pad=0) -> types.Datum:
        """A datum of ``before`` + ``image`` + ``after``; ``pad`` more (or, below 0, fewer) leading
        targets, so the inputs keep the length of model_input."""
        chunks = [types.EncodedTextChunk(tokens=before), image, types.EncodedTextChunk(tokens=after)]
        return types.Datum(
            model_input=types.ModelInput(chunks=chunks),
            loss_fn_inputs={
                "target_tokens": [0] * max(pad, 0) + targets[max(-pad, 0) :],
                "weights": [0.0] * max(pad, 0) + weights[max(-pad, 0) :],
            },
        )

    as_jpeg = types.ImageChunk(data=picture, format="jpeg", expected_tokens=count)
    _refused(
        tc, [variant(before, as_jpeg, after)], "datum 0: image 0: the chunk says jpeg but the bytes are PNG"
    )
    image = types.ImageChunk(data=picture, format="png", expected_tokens=count)
    loose = variant(before + [template.image_token_id], image, after, pad=1)
    _refused(tc, [loose], r"datum 0: model_input holds 1 image placeholder token\(s\) <\|image_pad\|>")
    unmarked = variant(before[:-1], image, after, pad=-1)  # no vision start token before the image
    _refused(tc, [unmarked], "datum 0: image 0 must follow the model's vision start token")


def test_an_image_on_a_text_only_base_model_is_one_line(server, tiny_model_dir):
    tc = trainer(server, tiny_model_dir)
    chunks = [
        types.EncodedTextChunk(tokens=[5, 6]),
        types.ImageChunk(data=png_bytes(), format="png", expected_tokens=4),
        types.EncodedTextChunk(tokens=[7]),
    ]
    text = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]},
    )
    image = types.Datum(
        model_input=types.ModelInput(chunks=chunks),
        loss_fn_inputs={"target_tokens": [6] * 7, "weights": [1.0] * 7},
    )
    _refused(tc, [text, image], "datum 1: holds an image, but the served base model .* reads text only")
