"""``TorchSampler`` with images on a tiny Qwen2.5-VL: prompts with images (chat rows or encoded
rows) are prefilled with their pixels and M-RoPE positions, so greedy sampling gives Hugging
Face's ``generate`` tokens (given the processor's inputs, ``mm_token_type_ids`` included) and the
returned log-probabilities are a teacher-forced forward's over the row with its images, which is
what the trainer computes on ``new_input_feature``; the prompts' common prefix runs once only
where its images are the same; a sampler with its own copy samples the trainer's synced LoRA;
bad image prompts are one line."""

import pytest
import torch
from tolerances import chain_tolerances, llama_sums
from vl_sampling_helpers import VL_CLASS, build_sharp_vl, hf_inputs, image_prompt, teacher_forced_logps

from twinkle.data_format import SamplingParams
from twinkle.sampler import TorchSampler
from twinkle.utils.errors import UserError

RED, GREEN, BLUE = (200, 30, 30), (30, 200, 30), (30, 30, 200)
PROMPTS = [
    image_prompt("What colour?", ((32, 32), RED)),
    image_prompt("Say hello."),  # a text-only row in the same batch
    image_prompt("Which is bigger?", ((48, 32), GREEN), ((32, 64), BLUE)),
    image_prompt("What colour?", ((32, 32), BLUE)),  # row 0's tokens, other pixels
]
# the tiny VL's language model (tiny_vl.py): 32 wide, 64 in the MLP, 2 layers; vocab about 600
TEXT = dict(hidden=32, intermediate=64, layers=2)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kwargs)


def sampled_logps(seq) -> torch.Tensor:
    return torch.tensor([entry[0][1] for entry in seq.logprobs])


def tolerances(row: dict, reference: torch.Tensor) -> dict:
    """Two fp32 orders of the language model's sums over the row (the vision tower's output is
    the same computation in both: one image at a time, the same patches)."""
    tokens = len(row["input_ids"])
    patches = 0 if "pixel_values" not in row else len(row["pixel_values"])
    sums = llama_sums(**TEXT, tokens=tokens, vocab=700) + llama_sums(32, 64, 1, tokens=max(1, patches))
    return chain_tolerances(sums, reference)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return build_sharp_vl(tmp_path_factory.mktemp("sharp-vl"))


@pytest.fixture(scope="module")
def sampler(vl_dir):
    sampler = TorchSampler(str(vl_dir), model_cls=VL_CLASS, dtype=torch.float32)
    sampler.set_template("Qwen2_5VLTemplate", model_id=str(vl_dir))
    return sampler


def test_greedy_with_images_equals_hf_generate(sampler):
    responses = sampler.sample(PROMPTS, greedy(8))
    for response in responses:
        seq = response.sequences[0]
        inputs = hf_inputs(sampler.lm, {**seq.new_input_feature, "input_ids": response.prompt_token_ids})
        with torch.no_grad():
            out = sampler.lm.generate(**inputs, max_new_tokens=8, do_sample=False)
        assert seq.tokens == out[0, len(response.prompt_token_ids) :].tolist()[: len(seq.tokens)]
        assert len(set(seq.tokens)) > 2  # varied tokens: a test that can fail
    assert responses[0].prompt_token_ids == responses[3].prompt_token_ids
    assert responses[0].sequences[0].tokens != responses[3].sequences[0].tokens  # the pixels count


def test_the_prompts_positions_are_m_rope_not_plain(sampler, monkeypatch):
    """Plain positions (0, 1, 2... on every axis) give other tokens than the ones checked above
    against ``generate``: the check sees the positions."""
    import twinkle.sampler.vision_prefill as prefill

    expected = [r.sequences[0].tokens for r in sampler.sample(PROMPTS, greedy(8))]
    monkeypatch.setattr(prefill, "rope_positions", lambda lm, ids, grid: torch.arange(len(ids)).expand(3, -1))
    plain = [r.sequences[0].tokens for r in sampler.sample(PROMPTS, greedy(8))]
    assert plain[1] == expected[1]  # the text-only row
    assert any(p != e for p, e in zip(plain, expected, strict=True))


def test_logprobs_equal_a_teacher_forced_forward_with_images(sampler):
    params = SamplingParams(max_tokens=8, temperature=0.8, top_k=50, seed=3, num_samples=2)
    for response in sampler.sample(PROMPTS, params):
        for seq in response.sequences:
            row = seq.new_input_feature
            assert row["input_ids"] == response.prompt_token_ids + seq.tokens
            expected = teacher_forced_logps(sampler.lm, row, len(seq.tokens))
            torch.testing.assert_close(sampled_logps(seq), expected, **tolerances(row, expected))


def test_encoded_rows_with_pixel_values_sample_as_chat_rows(sampler):
    template = sampler._template()
    encoded = [template.encode(p["messages"], add_generation_prompt=True) for p in PROMPTS]
    rows = [{k: v for k, v in row.items() if k != "messages"} for row in encoded]
    assert "pixel_values" in rows[0] and "pixel_values" not in rows[1]
    chat = [r.sequences[0].tokens for r in sampler.sample(PROMPTS, greedy(6))]
    assert [r.sequences[0].tokens for r in sampler.sample(rows, greedy(6))] == chat


def test_copies_of_one_prompt_share_its_prefix_images_included(sampler, monkeypatch):
    """GRPO's copies of one prompt: the whole prompt but its last token runs once, image and all;
    prompts alike but for their pixels share only the text before the first image. Either way
    each row samples what it samples alone."""
    import twinkle.sampler.decode as decode

    lead = "Look closely at the picture below and answer in one word, please. "
    same = [image_prompt(lead + "<image>What colour?", ((32, 32), RED))] * 3
    alike = [image_prompt(lead + "<image>What colour?", ((32, 32), c)) for c in (RED, GREEN, BLUE)]
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


def test_a_synced_copy_samples_what_the_trainer_samples(vl_dir):
    from peft import LoraConfig

    from twinkle.checkpoint_engine import CheckpointEngineManager
    from twinkle.model import TransformersModel

    model = TransformersModel(model_id=str(vl_dir), model_cls=VL_CLASS)
    model.add_adapter_to_model(
        "default", LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    )
    model.set_template("Qwen2_5VLTemplate", model_id=str(vl_dir))
    colocated = TorchSampler(model)
    own = TorchSampler(str(vl_dir), model_cls=VL_CLASS, dtype=torch.float32)
    own.set_template("Qwen2_5VLTemplate", model_id=str(vl_dir))
    CheckpointEngineManager(model=model, sampler=own).sync_weights()
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=7, num_samples=2)
    mine = [s for r in colocated.sample(PROMPTS, params) for s in r.sequences]
    theirs = [s for r in own.sample(PROMPTS, params) for s in r.sequences]
    assert [s.tokens for s in mine] == [s.tokens for s in theirs]
    base = [s.tokens for r in own.sample(PROMPTS, params, use_base_model=True) for s in r.sequences]
    assert base != [s.tokens for s in theirs]  # the synced adapter is what changed the tokens
    # the trainer's forward over the rows (what GRPO trains on) gives the sampled log-probs
    rows = [s.new_input_feature for s in mine]
    logps = model.forward_only(inputs=rows)["logps"]
    for i, (seq, row) in enumerate(zip(mine, rows, strict=True)):
        n, length = len(seq.tokens), len(row["input_ids"])
        got = logps[i, length - n : length].float()
        torch.testing.assert_close(sampled_logps(seq), got, **tolerances(row, got))
    # a GRPO step on them: at the sampled log-probs no ratio is clipped, and the adapter moves
    from twinkle.loss import GRPOLoss

    model.set_loss(GRPOLoss())
    model.set_optimizer("AdamW", lr=1e-2)
    old = [[entry[0][1] for entry in s.logprobs] for s in mine]
    advantages = [1.0 if i % 2 else -1.0 for i in range(len(rows))]
    model.forward_backward(inputs=rows, old_logps=old, advantages=advantages)
    assert model.clip_grad_and_step()
    assert model.calculate_metric(is_training=True)["clip_fraction"] == 0.0
    after = [s.tokens for r in colocated.sample(PROMPTS, params) for s in r.sequences]
    assert after != [s.tokens for s in mine]


def test_bad_image_prompts_are_one_line(sampler, vl_dir, tiny_model_dir):
    row = sampler._template().encode(PROMPTS[0]["messages"], add_generation_prompt=True)
    # no model_cls: a Qwen2.5-VL folder (no AutoModelForCausalLM class) loads whole, as vLLM loads it
    limited = TorchSampler(str(vl_dir), engine_args={"limit_mm_per_prompt": {"image": 1}})
    assert type(limited.lm).__name__ == VL_CLASS
    limited.set_template("Qwen2_5VLTemplate", model_id=str(vl_dir))
    assert (
        limited.sample(PROMPTS[0], greedy(2))[0].sequences[0].tokens
        == sampler.sample(PROMPTS[0], greedy(2))[0].sequences[0].tokens
    )
    cases = [
        (sampler, {"input_ids": row["input_ids"]}, r"input row 0 has 16 image tokens, but its images .* take 0;"),
        (limited, PROMPTS[2], r"input row 0 holds 2 images, more than engine_args limit_mm_per_prompt allows \(1\)"),
        (TorchSampler(str(tiny_model_dir)), {k: row[k] for k in ("input_ids", "pixel_values", "image_grid_thw")},
         r"input row 0 holds images \(pixel_values\), but the sampler's model \(LlamaForCausalLM\) reads text only"),
    ]  # fmt: skip
    for target, prompt, message in cases:
        with pytest.raises(UserError, match=message) as info:
            target.sample(prompt, greedy(2))
        assert "\n" not in str(info.value)


def test_an_image_placeholder_is_never_drawn(sampler):
    """A row whose completion held ``<|image_pad|>`` could not be trained on (no image behind the
    token): with its logit raised far above the rest, greedy sampling takes the next best token,
    and the reported log-probabilities stay the model's own."""
    image_pad = sampler.lm.config.image_token_id

    def raise_placeholder(module, inputs, output):
        output[..., image_pad] += 100.0
        return output

    handle = sampler.lm.lm_head.register_forward_hook(raise_placeholder)
    try:
        response = sampler.sample(PROMPTS[1], greedy(4, logprobs=2))[0]
        seq = response.sequences[0]
        inputs = hf_inputs(sampler.lm, {"input_ids": response.prompt_token_ids})
        with torch.no_grad():
            assert sampler.lm.generate(**inputs, max_new_tokens=1, do_sample=False)[0, -1] == image_pad
    finally:
        handle.remove()
    assert image_pad not in seq.tokens and len(seq.tokens) == 4
    assert seq.logprobs[0][1][0] == image_pad and seq.logprobs[0][1][1] > -1e-3  # the model's own top token


def user(content: str, *images: bytes) -> dict:
    return {"messages": [{"role": "user", "content": content, "images": list(images)}]}


def test_qwen3_vl_samples_as_hf_generate_and_scores_as_its_forward(tmp_path):
    """The other Qwen M-RoPE family: Qwen3-VL (16-pixel patches, deepstack features), loaded whole
    from its folder alone."""
    from tiny_qwen3_vl import build_tiny_qwen3_vl, picture

    folder = build_tiny_qwen3_vl(tmp_path / "qwen3-vl")
    sampler = TorchSampler(str(folder), dtype=torch.float32)
    with torch.no_grad():  # sharpened as build_sharp_vl does: clear greedy margins
        for name, p in sampler.lm.named_parameters():
            if p.dim() == 2 and ".visual." not in f".{name}":
                p.mul_(8)
    sampler.set_template("Qwen3VLTemplate", model_id=str(folder))
    prompts = [
        user("<image>What colour?", picture((64, 64), RED)),
        user("<image>What colour?", picture((64, 64), BLUE)),
        user("<image><image>Which?", picture((64, 32), GREEN), picture((32, 64), RED)),
    ]
    responses = sampler.sample(prompts, greedy(6, logprobs=1))
    for response in responses:
        seq = response.sequences[0]
        inputs = hf_inputs(sampler.lm, {**seq.new_input_feature, "input_ids": response.prompt_token_ids})
        with torch.no_grad():
            out = sampler.lm.generate(**inputs, max_new_tokens=6, do_sample=False)
        assert seq.tokens == out[0, len(response.prompt_token_ids) :].tolist()[: len(seq.tokens)]
        expected = teacher_forced_logps(sampler.lm, seq.new_input_feature, len(seq.tokens))
        torch.testing.assert_close(
            sampled_logps(seq), expected, **tolerances(seq.new_input_feature, expected)
        )
    assert responses[0].sequences[0].tokens != responses[1].sequences[0].tokens
