"""What the ``tests/server/test_image_chunks_<family>.py`` modules share: a tiny vision-language
base sharpened so greedy choices win by clear margins, a server of it, conversations encoded with
their pictures, the same training steps in process, and the two checks every family passes
through the official SDK:

- ``train_as_the_in_process_model``: a forward_backward with image chunks, then an Adam step,
  twice, gives the in-process model's losses and adapter (LoRA on the language model only);
- ``greedy_as_the_in_process_sampler``: a greedy sample of a prompt with a picture equals the
  in-process ``TorchSampler``'s token for token with the same log-probs, and another picture
  behind the same tokens changes the tokens.

Tolerances: training sums the same fp32 terms in other orders (``test_image_chunks``: 1e-5
relative on the loss, 1e-5 absolute on the adapter after Adam steps); sampling compares log-probs
with ``chain_tolerances`` of the language model's sums and the ``vision_sums`` a family gives."""

import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import tinker
import torch
from tinker import types
from tolerances import chain_tolerances, llama_sums

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from serving import KEY_A, start  # noqa: E402  (after the server tests' folder is on the path)
from test_image_chunks import IGNORE, LR, chunked  # noqa: E402
from tiny_qwen3_vl import picture  # noqa: E402

RED, BLUE = (200, 30, 30), (30, 30, 200)
ADAM_EPS = 1e-12  # the SDK's AdamParams default
QWEN_KEYS = ("input_ids", "pixel_values", "image_grid_thw")  # what a Qwen VL sampler is given


def qwen_tower_sums(row: dict) -> list:
    """The sums of a Qwen VL tower's 2 blocks over the row's patches."""
    return llama_sums(32, 64, 2, tokens=len(row["pixel_values"]))


def sharpened(build: Callable[[Path], Path], model_cls: str, out: Path, factor: Callable) -> Path:
    """The checkpoint ``build`` makes in ``out / 'plain'``, each parameter multiplied by
    ``factor(name, parameter)`` (1 leaves it), saved with the plain one's tokenizer, template
    and processor files in ``out / 'sharp'``."""
    import transformers

    plain = build(out / "plain")
    model = getattr(transformers, model_cls).from_pretrained(str(plain), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = factor(name, p)
            if scale != 1:
                p.mul_(scale)
    sharp = out / "sharp"
    model.save_pretrained(sharp)
    for f in plain.iterdir():
        if f.suffix in (".json", ".jinja", ".txt") and not (sharp / f.name).exists():
            shutil.copy(f, sharp / f.name)
    return sharp


def serve(folder: Path, tmp_path_factory) -> Iterator:
    """A server of ``folder`` for a module-scoped fixture to ``yield from``."""
    torch.manual_seed(0)
    running = start(folder, tmp_path_factory.mktemp("srv"))
    yield running
    running.stop()


def encoded(template, question: str, answer: str, size, colour) -> tuple[dict, bytes]:
    """A one-picture conversation encoded by ``template``, and the picture."""
    image = picture(size, colour)
    messages = [
        {"role": "user", "content": "<image>" + question, "images": [image]},
        {"role": "assistant", "content": answer},
    ]
    return template.encode(messages), image


def prompt_of(template, colour, size) -> tuple[dict, types.ModelInput]:
    """A question about a ``size`` picture of ``colour`` encoded for generation, and the same
    prompt as the SDK sends it: text chunks around an ``ImageChunk``."""
    image = picture(size, colour)
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


def training_client(running, folder: Path):
    """A rank-4 LoRA training client of ``folder`` on ``running``, for key A."""
    client = tinker.ServiceClient(base_url=running.url, api_key=KEY_A)
    return client.create_lora_training_client(base_model=str(folder), rank=4, train_unembed=False).result()


def local_steps(
    folder: Path, model_cls: str, adapter: str, rows: list[dict], steps: int, eps: float = ADAM_EPS
) -> tuple[dict, list[float]]:
    """The same steps in process (``test_image_chunks.local_steps`` on ``model_cls``)."""
    from twinkle.loss.token_weighted_ce import TokenWeightedCrossEntropyLoss
    from twinkle.model import MultiLoraTransformersModel
    from twinkle.model.forward import causal_lm_of
    from twinkle.processor.collate import collate
    from twinkle.server.datums import lora_config

    model = MultiLoraTransformersModel(str(folder), max_loras=2, max_r=8, model_cls=model_cls)
    model.add_adapter_to_model(adapter, lora_config(4, causal_lm_of(model.model)))
    model.set_loss(TokenWeightedCrossEntropyLoss(reduction="sum"), adapter_name=adapter)
    model.set_optimizer("AdamW", lr=LR, adapter_name=adapter, betas=(0.9, 0.95), eps=eps, weight_decay=0.0)
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


def train_as_the_in_process_model(
    running, folder: Path, template, conversations: list, model_cls: str, vision: str, eps: float = ADAM_EPS
) -> tuple[object, list[tuple[dict, bytes]]]:
    """Two forward_backward and Adam steps of ``conversations`` (``(question, answer, size,
    colour)``) as image chunks equal the in-process model's; the adapter holds no key with
    ``vision`` in it. The training client and the encoded rows, for a family's own checks."""
    encoded_rows = [encoded(template, *c) for c in conversations]
    data = [chunked(row, image, template.image_token_id) for row, image in encoded_rows]
    tc = training_client(running, folder)
    losses = []
    for _ in range(2):
        out = tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=LR, eps=eps)).result()
        losses.append(out.metrics["loss:sum"])
    assert [len(o["logprobs"].tolist()) for o in out.loss_fn_outputs] == [
        len(row["input_ids"]) - 1 for row, _ in encoded_rows
    ]
    s = running.app.state.server
    name = s.registry.runs[tc.model_id].adapter
    state = s.engine.core.adapter_state(name)
    assert state and not [k for k in state if vision in k]  # LoRA on the language model only
    expected_state, expected_losses = local_steps(
        folder, model_cls, name, [r for r, _ in encoded_rows], 2, eps
    )
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert losses[1] < losses[0]
    assert state.keys() == expected_state.keys()
    for k, v in expected_state.items():
        torch.testing.assert_close(state[k], v, atol=1e-5, rtol=0, msg=lambda m, k=k: f"{k}: {m}")
    return tc, encoded_rows


def greedy_as_the_in_process_sampler(
    running, folder: Path, template, model_cls: str, size, keys: tuple[str, ...], vision_sums: Callable
) -> None:
    """Greedy samples of a ``size`` picture, red then blue, equal the in-process sampler's given
    the row's ``keys``; ``vision_sums(row)`` are the vision side's sums for the tolerance."""
    from twinkle.data_format import SamplingParams
    from twinkle.sampler import TorchSampler

    local = TorchSampler(str(folder), model_cls=model_cls, dtype=torch.float32)
    client = tinker.ServiceClient(base_url=running.url, api_key=KEY_A)
    sampler = client.create_sampling_client(base_model=str(folder)).result()
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    seen = {}
    for colour in (RED, BLUE):
        row, prompt = prompt_of(template, colour, size)
        out = sampler.sample(prompt, 1, greedy).result()
        (mine,) = local.sample({k: row[k] for k in keys}, SamplingParams(max_tokens=8, temperature=0))
        seq, expected = out.sequences[0], mine.sequences[0]
        assert list(seq.tokens) == expected.tokens and len(set(seq.tokens)) > 2
        want = torch.tensor([entry[0][1] for entry in expected.logprobs])
        got = torch.tensor(list(seq.logprobs))
        sums = llama_sums(
            32, 64, 2, tokens=len(row["input_ids"]) + len(seq.tokens), vocab=len(template.tokenizer)
        )
        sums += vision_sums(row)
        torch.testing.assert_close(got, want, **chain_tolerances(sums, want))
        seen[colour] = list(seq.tokens)
    assert seen[RED] != seen[BLUE]  # the picture behind the same tokens is seen
