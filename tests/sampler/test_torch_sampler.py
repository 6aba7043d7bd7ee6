"""``TorchSampler``: batched KV-cache generation, rows stopping on their own, seeded sampling,
log-probabilities equal to a training forward's, adapters, and one-line errors.

Greedy tests run a "sharp" copy of the tiny model (its matrices scaled up), whose greedy tokens
vary and win by clear margins; the random tiny model itself is nearly uniform."""

import math
import shutil

import pytest
import torch
from peft import LoraConfig

from twinkle.data_format import SamplingParams
from twinkle.model import MultiLoraTransformersModel
from twinkle.model.forward import causal_lm_of
from twinkle.sampler import TorchSampler, vLLMSampler
from twinkle.sampler.vllm_engine import vllm_missing
from twinkle.utils.errors import UserError

PROMPTS = [
    {"messages": [{"role": "user", "content": "Who are you?"}]},
    {"messages": [{"role": "user", "content": "Hi there, tell me about Paris France please"}]},
    {"messages": [{"role": "user", "content": "twinkle"}]},
]


@pytest.fixture(scope="module")
def sharp_dir(tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("sharp-model")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(16)
    model.save_pretrained(out)
    for f in tiny_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture
def sharp(sharp_dir):
    return TorchSampler(str(sharp_dir))


def trainer_logps(lm, row: dict, n: int) -> torch.Tensor:
    """A plain training-style forward: the log-probability of each of the last ``n`` tokens."""
    ids = torch.tensor([row["input_ids"]])
    with torch.no_grad():
        logps = torch.log_softmax(lm(input_ids=ids, use_cache=False).logits.float(), dim=-1)
    targets = ids[0, 1:]
    return logps[0, :-1].gather(-1, targets[:, None]).squeeze(-1)[-n:]


def sampled_logps(seq) -> torch.Tensor:
    return torch.tensor([entry[0][1] for entry in seq.logprobs])


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kwargs)


def test_greedy_equals_hf_generate(sharp):
    responses = sharp.sample(PROMPTS, greedy(10))
    prompts = [r.prompt_token_ids for r in responses]
    width = max(map(len, prompts))
    pad = sharp.tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = sharp.lm.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=pad
        )
    for i, response in enumerate(responses):
        seq = response.sequences[0]
        assert seq.tokens == out[i, width : width + len(seq.tokens)].tolist()
        assert len(set(seq.tokens)) > 3  # a test that could fail: varied tokens


def test_rows_stop_independently_and_padding_changes_nothing(sharp):
    alone = [sharp.sample(p, greedy(8))[0].sequences[0] for p in PROMPTS[:2]]
    assert [s.stop_reason for s in alone] == ["length", "length"]
    # row 0 gets an end-of-sequence token it emits at step 4 and row 1 never emits
    eos = next(t for t in alone[0].tokens[3:] if t not in alone[1].tokens and t not in alone[0].tokens[:3])
    stop_at = alone[0].tokens.index(eos) + 1
    sharp.lm.generation_config.eos_token_id = [sharp.tokenizer.eos_token_id, eos]
    both = [r.sequences[0] for r in sharp.sample(PROMPTS[:2], greedy(8))]
    assert both[0].stop_reason == "stop" and both[0].tokens == alone[0].tokens[:stop_at]
    assert both[1].stop_reason == "length" and both[1].tokens == alone[1].tokens
    assert len(both[0].logprobs) == stop_at and len(both[1].logprobs) == 8


def test_a_stop_string_ends_its_row_only(sharp):
    alone = [sharp.sample(p, greedy(8))[0].sequences[0] for p in PROMPTS[:2]]
    other = alone[1].decoded
    pieces = [sharp.tokenizer.decode([t]) for t in alone[0].tokens]
    at = next(i for i in range(2, 8) if len(pieces[i].strip()) >= 2 and pieces[i] not in other)
    stop = pieces[at]
    both = [r.sequences[0] for r in sharp.sample(PROMPTS[:2], greedy(8, stop=stop))]
    first = next(i for i, p in enumerate(pieces) if stop in "".join(pieces[: i + 1]))
    assert both[0].stop_reason == "stop" and both[0].tokens == alone[0].tokens[: first + 1]
    assert stop not in both[0].decoded
    assert both[1].stop_reason == "length" and both[1].tokens == alone[1].tokens
    kept = sharp.sample(PROMPTS[0], greedy(8, stop=stop, include_stop_str_in_output=True))
    assert kept[0].sequences[0].decoded.endswith(stop)


def test_same_seed_same_samples_other_seed_differs(sharp):
    params = dict(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, num_samples=2)
    first = sharp.sample(PROMPTS, SamplingParams(seed=7, **params))
    again = sharp.sample(PROMPTS, SamplingParams(seed=7, **params))
    other = sharp.sample(PROMPTS, SamplingParams(seed=8, **params))
    tokens = [[s.tokens for s in r.sequences] for r in first]
    assert tokens == [[s.tokens for s in r.sequences] for r in again]
    assert tokens != [[s.tokens for s in r.sequences] for r in other]


def test_num_samples_gives_that_many_sequences_per_prompt(sharp):
    responses = sharp.sample(PROMPTS[:2], SamplingParams(max_tokens=6, num_samples=4, seed=0, logprobs=3))
    assert len(responses) == 2 and all(len(r.sequences) == 4 for r in responses)
    assert len({tuple(s.tokens) for s in responses[0].sequences}) > 1
    for seq in responses[0].sequences:
        assert all(
            len(entry) == 3 and entry[0][0] == t for entry, t in zip(seq.logprobs, seq.tokens, strict=True)
        )
        others = [lp for _, lp in seq.logprobs[0][1:]]
        assert others == sorted(others, reverse=True)


def test_logprobs_equal_a_training_forward(sharp):
    """Temperature, top-k and top-p change what is drawn, not the reported log-probabilities:
    those of the model at temperature 1, as the trainer computes them."""
    params = SamplingParams(max_tokens=8, temperature=0.7, top_p=0.8, top_k=20, seed=3, num_samples=2)
    for response in sharp.sample(PROMPTS, params):
        for seq in response.sequences:
            expected = trainer_logps(sharp.lm, seq.new_input_feature, len(seq.tokens))
            torch.testing.assert_close(sampled_logps(seq), expected, rtol=0, atol=1e-4)


def test_new_input_feature_is_a_training_row(make_model):
    model = make_model(init_lora_weights=False)
    sampler = TorchSampler(model)
    responses = sampler.sample(PROMPTS, SamplingParams(max_tokens=5, seed=1))
    rows = [s.new_input_feature for r in responses for s in r.sequences]
    for r, row in zip(responses, rows, strict=True):
        seq, prompt = r.sequences[0], r.prompt_token_ids
        assert row["input_ids"] == prompt + seq.tokens
        assert row["labels"] == [-100] * len(prompt) + seq.tokens
        assert row["position_ids"] == list(range(len(row["input_ids"])))
        assert row["messages"][-1] == {"role": "assistant", "content": seq.decoded}
    loss = model.forward_backward(inputs=rows)
    assert math.isfinite(loss) and loss > 0
    assert model.clip_grad_and_step()


def test_colocated_adapter_name_picks_the_trainer_adapter(tiny_model_dir):
    model = MultiLoraTransformersModel(str(tiny_model_dir), max_loras=2, max_r=4)
    for name in ("a", "b"):
        model.add_adapter_to_model(name, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        model.set_optimizer("AdamW", lr=5e-2, adapter_name=name)
    row = {"messages": [{"role": "user", "content": "Who are you?"}]}
    rows = [row | {"messages": row["messages"] + [{"role": "assistant", "content": "I am twinkle"}]}]
    for _ in range(2):  # only a learns: a and b now compute different functions
        model.forward_backward(inputs=rows, adapter_name="a")
        model.clip_grad_and_step(adapter_name="a")
    sampler = TorchSampler(model)
    params = SamplingParams(max_tokens=6, seed=5)
    seen = {}
    for name in ("a", "b"):
        seq = sampler.sample(row, params, adapter_name=name)[0].sequences[0]
        out = model.forward_only(inputs=[seq.new_input_feature], adapter_name=name)
        torch.testing.assert_close(sampled_logps(seq), out["logps"][0, -len(seq.tokens) :], rtol=0, atol=1e-4)
        seen[name] = seq
    # the same seed draws from different distributions
    assert not torch.allclose(sampled_logps(seen["a"]), sampled_logps(seen["b"]), atol=1e-3)


def test_adapter_path_loads_a_saved_adapter(make_model, tiny_model_dir, tmp_path):
    model = make_model(init_lora_weights=False)
    folder = model.save("ckpt", output_dir=str(tmp_path))
    sampler = TorchSampler(str(tiny_model_dir))
    params = SamplingParams(max_tokens=6, seed=2)
    with_adapter = sampler.sample(PROMPTS[0], params, adapter_path=folder)[0].sequences[0]
    base = sampler.sample(PROMPTS[0], params)[0].sequences[0]
    lm = causal_lm_of(model.model)
    expected = trainer_logps(lm, with_adapter.new_input_feature, len(with_adapter.tokens))
    torch.testing.assert_close(sampled_logps(with_adapter), expected, rtol=0, atol=1e-4)
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    base_expected = trainer_logps(plain, base.new_input_feature, len(base.tokens))
    torch.testing.assert_close(sampled_logps(base), base_expected, rtol=0, atol=1e-4)
    assert not torch.allclose(
        trainer_logps(lm, base.new_input_feature, len(base.tokens)), base_expected, atol=1e-3
    )


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: SamplingParams(max_tokens=-1), r"max_tokens must be an integer >= 0"),
        (lambda: SamplingParams(prompt_logprobs=-1), r"prompt_logprobs must be an integer >= 0"),
        (lambda: SamplingParams(repetition_penalty=0), r"repetition_penalty must be a number > 0"),
        (lambda: SamplingParams(top_p=0), r"top_p must be in \(0, 1\]"),
        (lambda: SamplingParams(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (lambda: SamplingParams(temperature=-0.5), r"temperature must be 0 \(greedy\) or a number >= 1e-06"),
        (lambda: SamplingParams(num_samples=0), r"num_samples must be an integer >= 1"),
        (lambda: SamplingParams(stop=[""]), r"each stop must be a non-empty string or a token id"),
    ],
)
def test_bad_sampling_params_are_one_line(make, message):
    with pytest.raises(UserError, match=message) as caught:
        make()
    assert "\n" not in str(caught.value)


def test_bad_sample_calls_are_one_line(make_model, tiny_model_dir):
    colocated = TorchSampler(make_model())
    own = TorchSampler(str(tiny_model_dir))
    long_prompt = {"input_ids": [5] * own.lm.config.max_position_embeddings}
    cases = [
        (
            lambda: colocated.sample(PROMPTS[0], adapter_name="nope"),
            r"unknown adapter 'nope'; adapters: default",
        ),
        (
            lambda: own.sample(PROMPTS[0], adapter_name="nope"),
            r"unknown adapter 'nope'; the sampler's adapters: none",
        ),
        (
            lambda: own.sample(long_prompt),
            r"input row 0 has 512 prompt tokens, but the model takes at most 512",
        ),
        (lambda: own.sample([{"text": "hi"}]), r"input row 0 has neither 'messages' nor 'input_ids'"),
        (lambda: own.sample(PROMPTS[0], adapter_path="/nonexistent"), r"is not a PEFT adapter folder"),
        (
            lambda: colocated.sample(PROMPTS[0], adapter_path="/x"),
            r"adapter_path= needs a sampler with its own",
        ),
    ]
    for call, message in cases:
        with pytest.raises(UserError, match=message) as caught:
            call()
        assert "\n" not in str(caught.value)


def test_prompt_reaching_max_positions_stops_with_length(tiny_model_dir):
    sampler = TorchSampler(str(tiny_model_dir))
    limit = sampler.lm.config.max_position_embeddings
    seq = sampler.sample({"input_ids": [5] * (limit - 3)}, SamplingParams(max_tokens=10, seed=0))[
        0
    ].sequences[0]
    assert len(seq.tokens) == 3 and seq.stop_reason == "length"


@pytest.mark.skipif(vllm_missing() is None, reason="vLLM runs here")
def test_vllm_sampler_without_vllm_runs_on_torch_sampler(tiny_model_dir, caplog):
    sampler = vLLMSampler(str(tiny_model_dir))
    assert isinstance(sampler.backend, TorchSampler)
    assert [r.message for r in caplog.records] == [
        f"vLLMSampler: {vllm_missing()}; its calls run on TorchSampler (plain PyTorch) instead"
    ]


def test_colocated_prompts_use_the_trainer_template(make_model):
    model = make_model()
    model.set_template("Template", default_system="You are Twinkle.")
    sampler = TorchSampler(model)
    prompt = sampler.sample(PROMPTS[0], SamplingParams(max_tokens=1, seed=0))[0].prompt_token_ids
    assert "You are Twinkle." in model.tokenizer.decode(prompt)
    assert model.tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    sampler.set_template("Template")
    plain = sampler.sample(PROMPTS[0], SamplingParams(max_tokens=1, seed=0))[0].prompt_token_ids
    assert "You are Twinkle." not in model.tokenizer.decode(plain)


@pytest.mark.parametrize("onednn", [True, False])
def test_decoding_products_on_either_library_give_the_trainers_logprobs(sharp_dir, monkeypatch, onednn):
    """Without the C kernel (``TWINKLE_NATIVE_GEMV=off``), a decoding step's few rows go to the
    library measured faster for each weight shape (``cpu_gemm.faster_here("gemv", ...)``); either
    gives the training forward's log-probs."""
    from twinkle.kernel import switched

    with switched({"TWINKLE_NATIVE_GEMV": "off"}):
        _libraries_give_the_trainers_logprobs(sharp_dir, monkeypatch, onednn)


def test_decoding_products_on_the_c_kernel_give_the_trainers_logprobs(sharp_dir, monkeypatch):
    from twinkle.kernel import gemv

    real, rows = gemv.native, []
    monkeypatch.setattr(gemv, "native", lambda x, w, b=None: rows.append(x.shape[0]) or real(x, w, b))
    _samples_give_the_trainers_logprobs(TorchSampler(str(sharp_dir)))
    assert rows and max(rows) <= gemv.MAX_ROWS


def _samples_give_the_trainers_logprobs(sampler):
    params = SamplingParams(max_tokens=8, temperature=0.7, top_p=0.8, top_k=20, seed=3, num_samples=2)
    for response in sampler.sample(PROMPTS, params):
        for seq in response.sequences:
            expected = trainer_logps(sampler.lm, seq.new_input_feature, len(seq.tokens))
            torch.testing.assert_close(sampled_logps(seq), expected, rtol=0, atol=1e-4)


def _libraries_give_the_trainers_logprobs(sharp_dir, monkeypatch, onednn):
    from twinkle.kernel import cpu_gemm

    real_choice, real_onednn, rows = cpu_gemm.faster_here, cpu_gemm._onednn, []
    monkeypatch.setattr(
        cpu_gemm, "faster_here", lambda p, w: onednn if p in cpu_gemm.FEW_ROWS else real_choice(p, w)
    )
    monkeypatch.setattr(cpu_gemm, "_onednn", lambda x, w, b: rows.append(x.shape[0]) or real_onednn(x, w, b))
    _samples_give_the_trainers_logprobs(TorchSampler(str(sharp_dir)))
    few = [n for n in rows if n <= 8]
    assert bool(few) == (onednn and cpu_gemm.onednn_enabled())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_shared_prompt_prefix_runs_once_and_changes_no_sample(sharp, monkeypatch, temperature):
    """Prompts that start alike have their common prefix prefilled once, in a row of its own, and
    its cache repeated (the pads then sit between prefix and rest): the same tokens and log-probs
    as the padded batch that runs every prompt whole."""
    import twinkle.sampler.decode as decode

    prefix = [5, 17, 99, 3, 41, 8, 250, 12, 9, 14, 300, 7]
    prompts = [{"input_ids": prefix + tail} for tail in ([2], [60, 61, 62, 63], [4, 8])]
    assert decode.shared_prefix([p["input_ids"] for p in prompts]) == len(prefix)
    widths = []
    real = decode.Decoder._forward
    monkeypatch.setattr(
        decode.Decoder,
        "_forward",
        lambda self, ids, *a: widths.append(tuple(ids.shape)) or real(self, ids, *a),
    )
    params = SamplingParams(max_tokens=12, temperature=temperature, num_samples=2, seed=5)
    shared = [s for r in sharp.sample(prompts, params) for s in r.sequences]
    assert widths[:2] == [(1, len(prefix)), (3, 4)]  # the prefix once, then each prompt's rest
    monkeypatch.setattr(decode, "SHARED_MIN", 10**9)
    sharp.reset_prefix_cache()  # else the second call continues the first call's kept rows
    widths.clear()
    whole = [s for r in sharp.sample(prompts, params) for s in r.sequences]
    assert widths[0] == (3, len(prefix) + 4)
    assert [s.tokens for s in shared] == [s.tokens for s in whole]
    for a, b in zip(shared, whole, strict=True):
        torch.testing.assert_close(sampled_logps(a), sampled_logps(b), rtol=0, atol=1e-5)
