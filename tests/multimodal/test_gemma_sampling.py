"""``TorchSampler`` with images on Gemma 3 and Gemma 4 (tiny random checkpoints,
``tiny_gemma_vl.py``, sharpened so greedy choices win by clear margins): greedy sampling gives
Hugging Face's ``generate`` tokens given the processor's inputs (the token types under each
family's name), for chat and encoded rows alike; without the token types the prefill's image
tokens attend causally and other tokens come out, so the comparison sees them; the returned
log-probabilities are a teacher-forced forward's over the row with its images and the trainer's
``forward_only`` logps of ``new_input_feature``; GRPO's copies of one prompt run its prefix once,
image included; the image placeholder is never drawn; a Qwen row on a Gemma model is one line."""

import shutil

import pytest
import torch
from tiny_gemma_vl import BUILDERS, TEMPLATES
from tiny_qwen3_vl import picture
from tolerances import chain_tolerances, llama_sums

from twinkle.data_format import SamplingParams
from twinkle.sampler import TorchSampler
from twinkle.utils.errors import UserError

CLASSES = {"gemma3": "Gemma3ForConditionalGeneration", "gemma4": "Gemma4ForConditionalGeneration"}
TOKEN_TYPES = {"gemma3": "token_type_ids", "gemma4": "mm_token_type_ids"}
SCALE = 8  # the language model's matrices scaled up: the random model's logits are nearly flat
# Gemma 4's image embedding is a projection initialised at std 0.02: scaled up, so that the
# pixels move the tokens (Gemma 3's projector is drawn at 0.2 by the builder)
GEMMA4_VISION_SCALE = 30
RED, GREEN, BLUE = (200, 30, 30), (30, 200, 30), (30, 30, 200)


def user(text: str, *pictures: tuple) -> dict:
    """A one-turn chat prompt, its pictures (``(size, colour)``) at the ``<image>`` tags of
    ``text``, or before it when it has none."""
    images = [picture(size, colour) for size, colour in pictures]
    content = text if "<image>" in text else "<image>" * len(images) + text
    message = {"role": "user", "content": content}
    return {"messages": [{**message, **({"images": images} if images else {})}]}


PROMPTS = [
    user("What colour?", ((32, 32), RED)),
    user("Say hello."),  # a text-only row in the same batch
    user("Which is bigger?", ((48, 32), GREEN), ((32, 64), BLUE)),
    user("What colour?", ((32, 32), BLUE)),  # row 0's tokens, other pixels
]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kwargs)


def _sharp(model_type: str, out) -> str:
    """The family's tiny checkpoint with its language model's matrices (and Gemma 4's image
    projection) scaled up, saved with its tokenizer and processor files."""
    import transformers

    plain = BUILDERS[model_type](out / "plain")
    model = getattr(transformers, CLASSES[model_type]).from_pretrained(str(plain), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "vision" not in name and "embed" not in name:
                p.mul_(SCALE)
            if "embed_vision.embedding_projection" in name:
                p.mul_(GEMMA4_VISION_SCALE)
    sharp = out / "sharp"
    model.save_pretrained(sharp)
    for f in plain.iterdir():
        if f.suffix in (".json", ".jinja", ".txt") and not (sharp / f.name).exists():
            shutil.copy(f, sharp / f.name)
    return str(sharp)


@pytest.fixture(scope="module", params=["gemma3", "gemma4"])
def family(request, tmp_path_factory):
    """``(model_type, folder, sampler)``: a sampler with its own copy of the family's checkpoint."""
    model_type = request.param
    folder = _sharp(model_type, tmp_path_factory.mktemp(model_type))
    sampler = TorchSampler(folder, model_cls=CLASSES[model_type], dtype=torch.float32)
    sampler.set_template(TEMPLATES[model_type], model_id=folder)
    return model_type, folder, sampler


def hf_inputs(model_type: str, lm, row: dict) -> dict:
    """A row as the family's processor hands it to the model: its tokens, images and which
    tokens are an image's."""
    ids = torch.tensor([row["input_ids"]])
    out = {"input_ids": ids, TOKEN_TYPES[model_type]: (ids == lm.config.image_token_id).long()}
    out.update({k: torch.as_tensor(row[k]) for k in ("pixel_values", "image_position_ids") if k in row})
    return out


def tolerances(row: dict, reference: torch.Tensor) -> dict:
    """Two fp32 orders of the language model's sums over the row and the vision tower's over an
    image's patches (its patch embedding, 48 terms, and projection)."""
    tokens = len(row["input_ids"])
    pixels = torch.as_tensor(row["pixel_values"]) if "pixel_values" in row else None
    patches = (
        1 if pixels is None else (pixels.shape[1] if pixels.dim() == 3 else (pixels.shape[-1] // 4) ** 2)
    )
    sums = llama_sums(32, 64, 2, tokens=tokens, vocab=700) + llama_sums(32, 64, 1, tokens=patches) + [48, 32]
    return chain_tolerances(sums, reference)


def sampled_logps(seq) -> torch.Tensor:
    return torch.tensor([entry[0][1] for entry in seq.logprobs])


def test_greedy_with_images_equals_hf_generate(family):
    model_type, _, sampler = family
    responses = sampler.sample(PROMPTS, greedy(8))
    for response in responses:
        seq = response.sequences[0]
        row = {**seq.new_input_feature, "input_ids": response.prompt_token_ids}
        with torch.no_grad():
            out = sampler.lm.generate(
                **hf_inputs(model_type, sampler.lm, row), max_new_tokens=8, do_sample=False
            )
        assert seq.tokens == out[0, len(response.prompt_token_ids) :].tolist()[: len(seq.tokens)]
        assert len(set(seq.tokens)) > 2  # varied tokens: a test that can fail
    assert responses[0].prompt_token_ids == responses[3].prompt_token_ids
    assert responses[0].sequences[0].tokens != responses[3].sequences[0].tokens  # the pixels count
    image_rows = [responses[i].sequences[0].new_input_feature for i in (0, 2)]
    assert all("pixel_values" in row for row in image_rows)
    assert ("image_position_ids" in image_rows[0]) == (model_type == "gemma4")


def test_the_prefill_runs_an_images_tokens_both_ways(family):
    """Each image row's first log-probability is Hugging Face's forward's with the token types
    (an image's tokens attend both ways), ten times closer to it than to the causal forward's
    (no token types): the tiny Gemma 4 moves its tokens little when run causally, so greedy
    tokens alone would not tell the two apart."""
    model_type, _, sampler = family
    responses = sampler.sample(PROMPTS, greedy(1, logprobs=1))
    for i in (0, 2, 3):
        seq = responses[i].sequences[0]
        inputs = hf_inputs(
            model_type, sampler.lm, {**seq.new_input_feature, "input_ids": responses[i].prompt_token_ids}
        )
        causal = {k: v for k, v in inputs.items() if k != TOKEN_TYPES[model_type]}
        with torch.no_grad():
            both, plain = (
                float(sampler.lm(**x, use_cache=False).logits[0, -1].float().log_softmax(-1)[seq.tokens[0]])
                for x in (inputs, causal)
            )
        ours = seq.logprobs[0][0][1]
        assert abs(ours - both) * 10 < abs(ours - plain), (ours, both, plain)


def test_encoded_rows_sample_as_chat_rows(family):
    _, _, sampler = family
    template = sampler._template()
    encoded = [template.encode(p["messages"], add_generation_prompt=True) for p in PROMPTS]
    rows = [{k: v for k, v in row.items() if k != "messages"} for row in encoded]
    assert "pixel_values" in rows[0] and "pixel_values" not in rows[1]
    chat = [r.sequences[0].tokens for r in sampler.sample(PROMPTS, greedy(6))]
    assert [r.sequences[0].tokens for r in sampler.sample(rows, greedy(6))] == chat


def test_logprobs_equal_a_teacher_forced_forward_and_the_trainers(family):
    """Sampled at temperature 0.8 from a trainer's model with a random LoRA (colocated): each
    token's log-probability is the model's over the whole row with its images, as a teacher-forced
    forward gives it and as ``forward_only`` computes it on ``new_input_feature``."""
    from peft import LoraConfig

    from twinkle.model import TransformersModel

    model_type, folder, _ = family
    torch.manual_seed(0)
    model = TransformersModel(folder, model_cls=CLASSES[model_type])
    model.add_adapter_to_model(
        "default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    )
    model.set_template(TEMPLATES[model_type], model_id=folder)
    sampler = TorchSampler(model)
    params = SamplingParams(max_tokens=6, temperature=0.8, top_k=50, seed=3, num_samples=2)
    sequences = [seq for response in sampler.sample(PROMPTS[:3], params) for seq in response.sequences]
    rows = [seq.new_input_feature for seq in sequences]
    trained = model.forward_only(inputs=rows)["logps"].float()
    lm = sampler.lm
    for i, (seq, row) in enumerate(zip(sequences, rows, strict=True)):
        n = len(seq.tokens)
        inputs = hf_inputs(model_type, lm, row)
        with torch.no_grad():
            logps = torch.log_softmax(lm(**inputs, use_cache=False).logits.float(), dim=-1)
        targets = inputs["input_ids"][0, 1:]
        expected = logps[0, :-1].gather(-1, targets[:, None]).squeeze(-1)[-n:]
        torch.testing.assert_close(sampled_logps(seq), expected, **tolerances(row, expected))
        labels = torch.as_tensor(row["labels"])
        assert labels[-n:].tolist() == seq.tokens and bool((labels[:-n] == -100).all())
        mine = trained[i][: len(labels)][-n:]
        torch.testing.assert_close(mine, expected, **tolerances(row, expected))


def test_copies_of_one_prompt_share_its_prefix_image_included(family, monkeypatch):
    """GRPO's copies of one prompt run all of it but its last token once, image and all; prompts
    alike but for their pixels share only the text before the first image. Either way each row
    samples what it samples alone."""
    import twinkle.sampler.decode as decode

    _, _, sampler = family
    lead = "Look closely at the picture and answer in one word, please. "
    same = [user(lead + "<image>What colour?", ((32, 32), RED))] * 3
    alike = [user(lead + "<image>What colour?", ((32, 32), c)) for c in (RED, GREEN, BLUE)]
    widths = []
    real = decode.Decoder._forward
    monkeypatch.setattr(
        decode.Decoder,
        "_forward",
        lambda self, ids, *a: widths.append(tuple(ids.shape)) or real(self, ids, *a),
    )
    for prompts in (same, alike):
        widths.clear()
        together = sampler.sample(prompts, greedy(6))
        length = len(together[0].prompt_token_ids)
        first_image = together[0].prompt_token_ids.index(sampler.lm.config.image_token_id)
        shared = length - 1 if prompts is same else first_image
        assert widths[:2] == [(1, shared), (3, length - shared)]
        widths.clear()
        alone = [sampler.sample(p, greedy(6))[0].sequences[0].tokens for p in prompts]
        assert [r.sequences[0].tokens for r in together] == alone
    assert len({tuple(t) for t in alone}) > 1  # the three pictures give different answers


def test_the_image_placeholder_is_never_drawn(family):
    """With the image token's logit raised far above the rest, ``generate`` takes it; the sampler
    takes the next best token and reports the model's own log-probabilities."""
    model_type, _, sampler = family
    image = sampler.lm.config.image_token_id

    def raise_placeholder(module, inputs, output):
        output[..., image] += 100.0
        return output

    handle = sampler.lm.lm_head.register_forward_hook(raise_placeholder)
    try:
        response = sampler.sample(PROMPTS[0], greedy(4, logprobs=2))[0]
        row = {**response.sequences[0].new_input_feature, "input_ids": response.prompt_token_ids}
        with torch.no_grad():
            out = sampler.lm.generate(
                **hf_inputs(model_type, sampler.lm, row), max_new_tokens=1, do_sample=False
            )
        assert out[0, -1] == image
    finally:
        handle.remove()
    seq = response.sequences[0]
    assert image not in seq.tokens and len(seq.tokens) == 4
    assert seq.logprobs[0][1][0] == image  # the model's own top token, reported


def test_a_qwen_row_on_a_gemma_model_is_one_line(family, tiny_vl_dir):
    from twinkle.template import get_template

    _, _, sampler = family
    qwen = get_template("Qwen2_5VLTemplate", str(tiny_vl_dir))
    row = qwen.encode(
        [{"role": "user", "content": "<image>Colour?", "images": [picture()]}], add_generation_prompt=True
    )
    with pytest.raises(UserError, match="input row 0: .*encoded for another model family") as info:
        sampler.sample([{k: v for k, v in row.items() if k != "messages"}], greedy(2))
    assert "\n" not in str(info.value)


def test_prompt_logprobs_with_images_equal_a_forward_with_the_token_types(family):
    model_type, _, sampler = family
    response = sampler.sample(PROMPTS[2], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    row = {**response.sequences[0].new_input_feature, "input_ids": response.prompt_token_ids}
    inputs = hf_inputs(model_type, sampler.lm, row)
    with torch.no_grad():
        logps = torch.log_softmax(sampler.lm(**inputs, use_cache=False).logits.float(), dim=-1)
    expected = logps[0, :-1].gather(-1, inputs["input_ids"][0, 1:, None]).squeeze(-1)
    assert response.prompt_logprobs[0] is None
    got = torch.tensor(response.prompt_logprobs[1:])
    torch.testing.assert_close(got, expected, **tolerances(row, expected))


def test_prompts_sharing_a_prefix_with_rests_of_other_lengths_sample_as_alone(family, monkeypatch):
    """The sliding-window layers count their window in cache slots: with the shared prefix run
    apart, the pads between it and a shorter rest would take up slots of the shortest prompt's
    window (its tokens change). So the prefix runs apart only where the rests are
    equally long, and each prompt samples what it samples alone."""
    import twinkle.sampler.decode as decode

    _, _, sampler = family
    lead = "Look closely at the words below and answer in one word, please, as you would. "
    prompts = [
        user(lead + "Hi?"),
        user(lead + "What is the colour of the sky at noon on a clear day?"),
        user(lead + "<image>Say what you see here now.", ((32, 32), GREEN)),
    ]
    alone = [sampler.sample(p, greedy(6))[0].sequences[0].tokens for p in prompts]
    assert [r.sequences[0].tokens for r in sampler.sample(prompts, greedy(6))] == alone
    real = decode.Decoder.__init__

    def pads_between(self, *args, **kwargs):  # the prefix run apart whatever the rests
        real(self, *args, **kwargs)
        self.even_rests = False

    monkeypatch.setattr(decode.Decoder, "__init__", pads_between)
    apart = [r.sequences[0].tokens for r in sampler.sample(prompts, greedy(6))]
    assert apart != alone  # the check sees the window
