"""A client script of the shape of upstream's ``client/tinker/multi_modal.py`` against a server
without keys on a tiny Qwen2.5-VL: a ``Preprocessor`` that makes image conversations
(``Message(images=[...])``), ``LazyDataset`` with the vision-language template, ``encode``,
``DataLoader`` batches turned into Tinker datums by ``input_feature_to_datum`` (the processed
images travel with them), ``forward_backward`` / ``optim_step`` every two batches and
``save_state`` after each epoch. The same batches' loss falls from epoch to epoch."""

import json
import sys
from pathlib import Path

import pytest
import torch
from serving import Running, free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multimodal"))

from tiny_vl import build_tiny_vl  # noqa: E402  (after the multimodal folder is on the path)
from vl_pictures import png_bytes  # noqa: E402

ANSWERS = [("red", (200, 30, 30)), ("green", (30, 200, 30)), ("blue", (30, 30, 200)), ("black", (0, 0, 0))]


@pytest.fixture
def keyless_vl(tmp_path):
    from twinkle.server import ServerConfig, create_app
    from twinkle.server.config import keyless_keys
    from twinkle.server.state import Limits

    model = build_tiny_vl(tmp_path / "vl")
    torch.manual_seed(0)
    config = ServerConfig(
        model_id=str(model),
        max_loras=2,
        max_r=16,
        output_dir=tmp_path / "srv",
        keys=keyless_keys("127.0.0.1", Limits()),
        keyless=True,
    )
    running = Running(create_app(config), free_port())
    yield running, model
    running.stop()


def _image_rows(folder: Path, n: int) -> Path:
    """``n`` rows of ``image`` (a PNG file) and ``text`` (its colour), as an OCR set has them."""
    folder.mkdir()
    lines = []
    for i in range(n):
        text, colour = ANSWERS[i % len(ANSWERS)]
        path = folder / f"{i}.png"
        path.write_bytes(png_bytes((32, 32 + 16 * (i % 2)), colour))
        lines.append(json.dumps({"image": str(path), "text": text}))
    rows = folder / "rows.jsonl"
    rows.write_text("\n".join(lines) + "\n")
    return rows


# the script calls the training client's methods on the future create_lora_training_client
# returns, as upstream's does; the SDK warns of it and serves it
@pytest.mark.filterwarnings("ignore:Using the future as the TrainingClient:FutureWarning")
def test_the_upstream_multi_modal_client_shape_trains(keyless_vl, tmp_path):
    from tinker import ServiceClient, types

    from twinkle import init_tinker_client
    from twinkle.data_format import Message, Trajectory
    from twinkle.dataloader import DataLoader
    from twinkle.dataset import DatasetMeta, LazyDataset
    from twinkle.preprocessor import Preprocessor
    from twinkle.server.common import input_feature_to_datum

    server, base_model = keyless_vl
    init_tinker_client()

    class ColourProcessor(Preprocessor):
        def __call__(self, rows):
            rows = self.map_col_to_row(rows)
            rows = [
                Trajectory(
                    messages=[
                        Message(role="user", content="<image>Name the colour.", images=[row["image"]]),
                        Message(role="assistant", content=row["text"]),
                    ]
                )
                for row in rows
            ]
            return self.map_row_to_col(rows)

    client = ServiceClient(base_url=server.url, api_key="EMPTY_TOKEN")
    training_client = client.create_lora_training_client(base_model=str(base_model), rank=16)
    dataset = LazyDataset(
        dataset_meta=DatasetMeta(str(_image_rows(tmp_path / "rows", 8)), data_slice=range(8))
    )
    dataset.set_template("Qwen2_5VLTemplate", model_id=str(base_model), max_length=512)
    dataset.map(ColourProcessor())
    dataset.encode(batched=True)
    dataloader = DataLoader(dataset=dataset, batch_size=2)

    losses: list[list[float]] = []
    saved = []
    for epoch in range(3):
        accumulated, epoch_losses = [], []
        for batch_idx, batch in enumerate(dataloader):
            accumulated.extend(input_feature_to_datum(feature) for feature in batch)
            if len(accumulated) >= 4 or batch_idx == len(dataloader) - 1:
                fwdbwd = training_client.forward_backward(accumulated, "cross_entropy")
                optim = training_client.optim_step(types.AdamParams(learning_rate=1e-2))
                epoch_losses.append(fwdbwd.result().metrics["loss:sum"])
                optim.result()
                accumulated = []
        losses.append(epoch_losses)
        saved.append(training_client.save_state(f"multimodal-epoch-{epoch + 1}").result().path)

    assert len(losses[0]) == 2 and all(len(e) == 2 for e in losses)  # 8 rows, two steps an epoch
    for step in range(2):  # the same batches each epoch (no shuffling): their loss falls
        assert losses[2][step] < losses[0][step], losses
    run = saved[0].split("/")[2]
    assert saved == [f"tinker://{run}/weights/multimodal-epoch-{e}" for e in (1, 2, 3)]


def test_twinkle_client_rows_carry_their_images(keyless_vl):
    """``twinkle_client``'s ``forward_only`` on rows a VL template encoded (upstream's
    ``client/twinkle/multi_modal.py`` sends them so, tensors as lists) scores them with their
    images: the log-probs of the Tinker datums ``input_feature_to_datum`` makes of the same rows."""
    import numpy as np
    from peft import LoraConfig
    from tinker import ServiceClient

    import twinkle
    from twinkle.server.common import input_feature_to_datum
    from twinkle.template import get_template
    from twinkle_client.model import MultiLoraTransformersModel

    server, base_model = keyless_vl
    template = get_template("Qwen2_5VLTemplate", model_id=str(base_model))
    rows = []
    for text, colour in ANSWERS[:2]:
        messages = [
            {"role": "user", "content": "<image>Name the colour.", "images": [png_bytes((32, 32), colour)]},
            {"role": "assistant", "content": text},
        ]
        row = template.encode(messages)
        rows.append({k: v.tolist() if hasattr(v, "tolist") else v for k, v in row.items()})
    twinkle.init_twinkle_client(base_url=server.url, api_key="EMPTY_TOKEN")
    model = MultiLoraTransformersModel(model_id=str(base_model))
    model.add_adapter_to_model("default", LoraConfig(r=4))
    ours = model.forward_only(inputs=rows, disable_lora=True).result["logps"]

    client = ServiceClient(base_url=server.url, api_key="EMPTY_TOKEN")
    tc = client.create_lora_training_client(base_model=str(base_model), rank=4, train_unembed=False).result()
    out = tc.forward(
        [input_feature_to_datum(r) for r in rows], "cross_entropy", {"disable_lora": 1.0}
    ).result()
    for b, r in enumerate(rows):
        n = len(r["labels"])
        trained = np.asarray(r["labels"][1:]) != -100
        expected = out.loss_fn_outputs[b]["logprobs"].to_numpy()[trained]
        np.testing.assert_allclose(ours[b, 1:n].numpy()[trained], expected, atol=1e-6, rtol=0)
