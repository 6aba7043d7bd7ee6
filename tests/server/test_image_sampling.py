"""Sampling with Tinker's ``ImageChunk`` through the official SDK on a server of a tiny
Qwen2.5-VL whose greedy choices win by clear margins (``vl_sampling_helpers.build_sharp_vl``):
a greedy sample with an image equals the in-process ``TorchSampler``'s on the same image and text
(token for token), with the same log-probs, prompt log-probs and their top-k; another picture
behind the same tokens changes them; a sampler on saved weights gives the log-probs the trainer
computes on prompt + completion with the image; bad image prompts are one line naming the prompt.

Tolerances: the server's model and the in-process sampler's own copy run the same fp32 sums in
orders that may differ (a zero LoRA beside the base, batched rows), so two results agree within
``tolerances.chain_tolerances`` of the language model's sums (and the vision tower's, which sees
the same patches either way)."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import tinker
import torch
from ports import free_port
from serving import KEY_A, start
from test_server_ray import _serve, _started, _stop, cluster, cluster_run  # noqa: F401 (cluster: a fixture)
from tinker import types
from tolerances import chain_tolerances, llama_sums

for folder in ("sampler", "multimodal"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / folder))

from vl_pictures import png_bytes  # noqa: E402
from vl_sampling_helpers import VL_CLASS, build_sharp_vl  # noqa: E402  (after the folders are on the path)

RED, BLUE = (200, 30, 30), (30, 30, 200)
TEXT = dict(hidden=32, intermediate=64, layers=2)  # tiny_vl.py's language model


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return build_sharp_vl(tmp_path_factory.mktemp("sharp-vl"))


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


@pytest.fixture(scope="module")
def local(vl_dir):
    from twinkle.sampler import TorchSampler

    return TorchSampler(str(vl_dir), model_cls=VL_CLASS, dtype=torch.float32)


def prompt_of(template, colour, question="What colour?", size=(32, 32)) -> tuple[dict, types.ModelInput]:
    """A chat prompt with one picture: the template's encoded row (its generation prompt
    appended) and the same prompt as the SDK sends it, the picture an ``ImageChunk`` in place of
    its placeholder tokens."""
    picture = png_bytes(size, colour)
    messages = [{"role": "user", "content": "<image>" + question, "images": [picture]}]
    row = template.encode(messages, add_generation_prompt=True)
    ids = list(row["input_ids"])
    first, count = ids.index(template.image_token_id), ids.count(template.image_token_id)
    chunks = [
        types.EncodedTextChunk(tokens=ids[:first]),
        types.ImageChunk(data=picture, format="png", expected_tokens=count),
        types.EncodedTextChunk(tokens=ids[first + count :]),
    ]
    return row, types.ModelInput(chunks=chunks)


def tolerances(row: dict, extra: int, reference: torch.Tensor) -> dict:
    sums = llama_sums(**TEXT, tokens=len(row["input_ids"]) + extra, vocab=700)
    return chain_tolerances(sums + llama_sums(32, 64, 1, tokens=len(row["pixel_values"])), reference)


def sampling_client(server, vl_dir):
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    return client.create_sampling_client(base_model=str(vl_dir)).result()


def test_greedy_with_an_image_equals_the_in_process_sampler(vl_server, vl_dir, template, local):
    from twinkle.data_format import SamplingParams

    sampler = sampling_client(vl_server, vl_dir)
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    seen = {}
    for colour in (RED, BLUE):
        row, prompt = prompt_of(template, colour)
        out = sampler.sample(
            prompt, 1, greedy, include_prompt_logprobs=True, topk_prompt_logprobs=3, topk_sample_logprobs=2
        ).result()
        (mine,) = local.sample(
            {k: row[k] for k in ("input_ids", "pixel_values", "image_grid_thw")},
            SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=3),
        )
        seq, expected = out.sequences[0], mine.sequences[0]
        assert list(seq.tokens) == expected.tokens and len(set(seq.tokens)) > 2
        want = torch.tensor([entry[0][1] for entry in expected.logprobs])
        got = torch.tensor(list(seq.logprobs))
        torch.testing.assert_close(got, want, **tolerances(row, len(seq.tokens), want))
        # the samples' top-2 come from a pass over prompt + completion with the image: the greedy
        # token is among them (first unless an image placeholder, never drawn, is), at its log-prob
        tops = [dict(top) for top in seq.topk_logprobs]
        assert all(token in top for token, top in zip(seq.tokens, tops, strict=True))
        of_top = torch.tensor([top[token] for token, top in zip(seq.tokens, tops, strict=True)])
        torch.testing.assert_close(of_top, got, **tolerances(row, len(seq.tokens), got))
        # the prompt's log-probs, the image's placeholders included, and their top-3
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(row["input_ids"])
        want_prompt = torch.tensor(mine.prompt_logprobs[1:])
        got_prompt = torch.tensor(out.prompt_logprobs[1:])
        torch.testing.assert_close(got_prompt, want_prompt, **tolerances(row, 0, want_prompt))
        top = torch.tensor([[lp for _, lp in pos] for pos in out.topk_prompt_logprobs[1:]])
        want_top = torch.tensor([[lp for _, lp in pos] for pos in mine.topk_prompt_logprobs[1:]])
        torch.testing.assert_close(top, want_top, **tolerances(row, 0, want_top))
        seen[colour] = (list(seq.tokens), got, got_prompt)
    # the same tokens with another picture: other samples, other log-probs after the image
    (red_tokens, _red_logps, red_prompt), (blue_tokens, _blue_logps, blue_prompt) = seen[RED], seen[BLUE]
    assert red_tokens != blue_tokens
    after = list(row["input_ids"]).index(template.image_token_id) + 1
    assert (red_prompt[after:] - blue_prompt[after:]).abs().max() > 1e-2


def test_a_saved_adapter_samples_what_the_trainer_scores(vl_server, vl_dir, template):
    """Train a step on an image datum, save the sampler weights, sample with the image: each
    sampled token's log-prob is the trainer's forward on prompt + completion with the image."""
    client = tinker.ServiceClient(base_url=vl_server.url, api_key=KEY_A)
    tc = client.create_lora_training_client(base_model=str(vl_dir), rank=4, train_unembed=False).result()
    row, prompt = prompt_of(template, RED)
    answer = template.tokenizer.encode("red", add_special_tokens=False)
    tc.forward_backward([_datum(prompt, answer)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=11)
    out = sampler.sample(prompt, 2, params).result()
    for seq in out.sequences:
        scored = tc.forward([_datum(prompt, list(seq.tokens))], "cross_entropy").result()
        n = len(seq.tokens)
        want = torch.tensor(scored.loss_fn_outputs[0]["logprobs"].tolist()[-n:])
        got = torch.tensor(list(seq.logprobs))
        torch.testing.assert_close(got, want, **tolerances(row, n, want))


def _datum(prompt: types.ModelInput, completion: list[int]) -> types.Datum:
    """Prompt + completion as a shifted datum whose targets are the completion (weights 1 on
    it); the image chunk stays in place."""
    chunks = list(prompt.chunks)
    last = chunks[-1].tokens
    inputs = chunks[:-1] + [types.EncodedTextChunk(tokens=list(last) + completion[:-1])]
    text = sum(len(c.tokens) for c in inputs if isinstance(c, types.EncodedTextChunk))
    image = sum(c.expected_tokens for c in inputs if isinstance(c, types.ImageChunk))
    n = text + image
    targets = [0] * (n - len(completion)) + completion
    weights = [0.0] * (n - len(completion)) + [1.0] * len(completion)
    return types.Datum(
        model_input=types.ModelInput(chunks=inputs),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.asarray(targets, dtype=np.int64)),
            "weights": types.TensorData.from_numpy(np.asarray(weights, dtype=np.float32)),
        },
    )


def _refused(sampler, prompt: types.ModelInput, pattern: str) -> None:
    with pytest.raises(Exception, match=pattern) as info:
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()
    assert "\n" not in str(info.value).strip(), str(info.value)


def test_bad_image_prompts_are_one_line_naming_the_prompt(vl_server, vl_dir, template):
    sampler = sampling_client(vl_server, vl_dir)
    row, prompt = prompt_of(template, RED)
    before, image, after = prompt.chunks
    n = image.expected_tokens

    def variant(*chunks) -> types.ModelInput:
        return types.ModelInput(chunks=list(chunks))

    declared = types.ImageChunk(data=image.data, format="png", expected_tokens=n + 1)
    _refused(
        sampler,
        variant(before, declared, after),
        rf"prompt: image 0 is {n} tokens for this model's image processor \(grid 1x8x8\), but its chunk "
        rf"declares expected_tokens={n + 1}",
    )
    garbage = types.ImageChunk(data=b"not a png", format="png", expected_tokens=n)
    _refused(
        sampler, variant(before, garbage, after), r"prompt: image 0 \(9 bytes of png\) cannot be decoded"
    )
    as_jpeg = types.ImageChunk(data=image.data, format="jpeg", expected_tokens=n)
    _refused(
        sampler, variant(before, as_jpeg, after), "prompt: image 0: the chunk says jpeg but the bytes are PNG"
    )
    unmarked = types.EncodedTextChunk(tokens=list(before.tokens)[:-1])  # no vision start token
    _refused(sampler, variant(unmarked, image, after), "prompt: image 0 must follow the model's vision start")
    # the placeholders sent as tokens, without the image behind them
    loose = types.ModelInput.from_ints(list(row["input_ids"]))
    _refused(sampler, loose, rf"prompt: model_input holds {n} image placeholder token\(s\) <\|image_pad\|>")


def test_base64_that_is_not_is_one_line(vl_server, vl_dir, template):
    sampler = sampling_client(vl_server, vl_dir)
    _, prompt = prompt_of(template, RED)
    body = {
        "sampling_session_id": sampler._sampling_session_id,
        "num_samples": 1,
        "prompt": json.loads(prompt.model_dump_json()),
        "sampling_params": {"max_tokens": 2},
    }
    body["prompt"]["chunks"][1]["data"] = "not base64!"
    reply = httpx.post(f"{vl_server.url}/api/v1/asample", json=body, headers={"X-API-Key": KEY_A}, timeout=60)
    assert reply.status_code == 400
    assert "prompt: image 0: data must be the image's bytes in base64" in reply.text


def test_an_image_prompt_on_a_text_only_base_model_is_one_line(server, tiny_model_dir):
    sampler = sampling_client(server, tiny_model_dir)
    prompt = types.ModelInput(
        chunks=[
            types.EncodedTextChunk(tokens=[5]),
            types.ImageChunk(data=png_bytes(), format="png", expected_tokens=16),
        ]
    )
    _refused(sampler, prompt, "prompt: holds an image, but the served base model .* reads text only")


@cluster_run
def test_the_ray_groups_sample_and_score_an_image_prompt(cluster, vl_dir, template, local, tmp_path):  # noqa: F811
    """``--mode ray --model-ranks 1 --sampler-ranks 1``: the prompt's processed images travel to
    the sampler group, which samples them (greedy: the in-process sampler's tokens), and to the
    model group, which scores the prompt with them."""
    from twinkle.data_format import SamplingParams

    row, prompt = prompt_of(template, RED)
    (mine,) = local.sample(
        {k: row[k] for k in ("input_ids", "pixel_values", "image_grid_thw")},
        SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=0),
    )
    port = free_port()
    proc = _serve(
        vl_dir, tmp_path, cluster, "--model-ranks", "1", "--sampler-ranks", "1", "--port", str(port)
    )
    try:
        sampler = sampling_client(SimpleNamespace(url=_started(proc, tmp_path, port)), vl_dir)
        greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
        out = sampler.sample(prompt, 1, greedy, include_prompt_logprobs=True).result()
    finally:
        _stop(proc, tmp_path)
    seq = out.sequences[0]
    assert list(seq.tokens) == mine.sequences[0].tokens
    want = torch.tensor([entry[0][1] for entry in mine.sequences[0].logprobs])
    torch.testing.assert_close(
        torch.tensor(list(seq.logprobs)), want, **tolerances(row, len(seq.tokens), want)
    )
    want_prompt = torch.tensor(mine.prompt_logprobs[1:])
    got_prompt = torch.tensor(out.prompt_logprobs[1:])
    torch.testing.assert_close(got_prompt, want_prompt, **tolerances(row, 0, want_prompt))
