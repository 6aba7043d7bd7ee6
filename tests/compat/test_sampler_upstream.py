"""Samplers in upstream's call shapes: ``engine_args``, ``vLLMSampler`` on a machine without
vLLM, prompts as trajectories or encoded rows, ``logprobs`` read as ``logprob[0][1]``,
``new_input_feature`` as a reward and the trainer read it, ``prompt_logprobs`` scoring with
``max_tokens=0``, the cache resets, and ``CheckpointEngineManager(model=, sampler=)``.

Every log-probability is compared with a plain forward of the same weights (fp32, 1e-4)."""

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.data_format import SamplingParams
from twinkle.model.forward import causal_lm_of
from twinkle.sampler import TorchSampler, vLLMSampler
from twinkle.sampler.vllm_engine import vllm_missing
from twinkle.template import Template
from twinkle.template.rows import IGNORE_INDEX
from twinkle.utils.errors import UserError

TOL = 1e-4  # fp32 on both sides; the sampler's CPU products differ from torch's in rounding only
UPSTREAM_ENGINE_ARGS = {
    "gpu_memory_utilization": 0.8,
    "max_model_len": 8192,
    "max_lora_rank": 32,
    "enable_lora": True,
    "enable_tower_connector_lora": True,
    "max_logprobs": 64,  # upstream's off-policy GKD script
}
TRAJS = [
    {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "user_data": [["answer", "5"]]},
    {"messages": [{"role": "user", "content": "Name a city in France"}], "user_data": [["answer", "Paris"]]},
]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).float().eval()


def log_softmax(lm, ids: list[int]) -> torch.Tensor:
    """``(len(ids) - 1, vocab)``: the log-probabilities predicting tokens 1.. of ``ids``."""
    with torch.no_grad():
        logits = lm(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def twinkle_records(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("twinkle") and r.levelno >= logging.WARNING
    ]


def test_upstream_engine_args_are_accepted_and_named_in_one_warning(tiny_model_dir, caplog):
    TorchSampler(str(tiny_model_dir), engine_args=UPSTREAM_ENGINE_ARGS)
    assert twinkle_records(caplog) == [
        "TorchSampler: engine_args gpu_memory_utilization, max_lora_rank, enable_lora, enable_tower_connector_lora, "
        "max_logprobs are vLLM engine settings with nothing to set in a PyTorch sampler; ignored"
    ]


@pytest.mark.parametrize(
    "engine_args, needle",
    [
        ({"gpu_mem": 0.5}, "TorchSampler: unknown engine_args gpu_mem; known: block_size"),
        ({"tensor_parallel_size": 2}, "engine_args tensor_parallel_size=2 needs vLLM on that many GPUs"),
        ({"max_model_len": 0}, "engine_args max_model_len=0 must be an integer >= 1"),
        ("gpu_memory_utilization=0.8", "TorchSampler(engine_args=...) takes a dict, got str"),
    ],
)
def test_bad_engine_args_are_one_line(tiny_model_dir, engine_args, needle):
    with pytest.raises(UserError) as caught:
        TorchSampler(str(tiny_model_dir), engine_args=engine_args)
    assert needle in str(caught.value) and "\n" not in str(caught.value)


def test_max_model_len_caps_prompt_plus_completion(tiny_model_dir):
    sampler = TorchSampler(str(tiny_model_dir), engine_args={"max_model_len": 40})
    (response,) = sampler.sample({"input_ids": [5] * 30}, SamplingParams(max_tokens=100, seed=0))
    assert len(response.sequences[0].tokens) == 10 and response.sequences[0].stop_reason == "length"
    with pytest.raises(
        UserError, match="input row 0 has 40 prompt tokens, but max_model_len is 40 positions"
    ):
        sampler.sample({"input_ids": [5] * 40}, SamplingParams(max_tokens=1))


def test_engine_seed_makes_unseeded_calls_repeatable(tiny_model_dir):
    def tokens(seed: int) -> list[list[int]]:
        sampler = TorchSampler(str(tiny_model_dir), engine_args={"seed": seed})
        return [[s.tokens for s in r.sequences] for r in sampler.sample(TRAJS, SamplingParams(max_tokens=6))]

    assert tokens(3) == tokens(3)
    assert tokens(3) != tokens(4)


@pytest.mark.skipif(vllm_missing() is None, reason="vLLM runs here")
def test_vllm_sampler_script_runs_on_torch_sampler(tiny_model_dir, make_model, tmp_path, reference, caplog):
    """The calls of upstream's sample script, on a machine without vLLM."""
    trainer = make_model(init_lora_weights=False)
    adapter = trainer.save("adapter", output_dir=str(tmp_path))
    sampler = vLLMSampler(
        model_id=str(tiny_model_dir), engine_args=dict(UPSTREAM_ENGINE_ARGS, max_loras=1), device_mesh=None
    )
    assert twinkle_records(caplog)[0].startswith("vLLMSampler: vllm is not installed")
    sampler.set_template("Qwen3_5Template", model_id=str(tiny_model_dir))
    params = SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, num_samples=1, seed=0)
    responses = sampler.sample(TRAJS, params, adapter_path=str(adapter))
    assert len(responses) == 2
    for response in responses:
        (seq,) = response.sequences
        assert sampler.template.tokenizer.decode(seq.tokens, skip_special_tokens=True) == seq.decoded
    sampler.reset_prefix_cache()
    sampler.reset_mm_cache()
    sampler.reset_encoder_cache()
    # the adapter ran: the sampled tokens' log-probabilities are the trainer's, not the base model's
    seq = responses[0].sequences[0]
    ids = seq.new_input_feature["input_ids"]
    mine = torch.tensor([lp[0][1] for lp in seq.logprobs])
    positions = torch.arange(len(ids) - len(seq.tokens) - 1, len(ids) - 1)
    base = log_softmax(reference, ids)[positions, torch.tensor(seq.tokens)]
    trained = log_softmax(causal_lm_of(trainer.model), ids)[positions, torch.tensor(seq.tokens)]
    assert (mine - trained).abs().max() < TOL < (mine - base).abs().max()


def test_grpo_rows_carry_what_rewards_and_the_loss_read(tiny_model_dir, reference):
    """Prompt rows as ``Dataset.encode(add_generation_prompt=True)`` makes them, sampled as
    upstream's GRPO script does."""
    template = Template(str(tiny_model_dir))
    rows = template.batch_encode(TRAJS, add_generation_prompt=True)
    sampler = TorchSampler(str(tiny_model_dir))
    params = SamplingParams(max_tokens=6, num_samples=2, logprobs=1, temperature=1.0, top_p=0.95, seed=5)
    responses = sampler.sample([row for row in rows for _ in range(2)], params)
    assert [len(r.sequences) for r in responses] == [2, 2, 2, 2]
    for row, response in zip([r for r in rows for _ in range(2)], responses, strict=True):
        for seq in response.sequences:
            feature = seq.new_input_feature
            n = len(row["input_ids"])
            assert feature["input_ids"] == row["input_ids"] + seq.tokens
            assert feature["labels"] == [IGNORE_INDEX] * n + seq.tokens  # exactly the completion
            assert feature["length"] == n + len(seq.tokens) == len(feature["position_ids"])
            assert feature["messages"] == [*row["messages"], {"role": "assistant", "content": seq.decoded}]
            assert feature["user_data"] == row["user_data"]
            old_logps = [logprob[0][1] for logprob in seq.logprobs]  # upstream's read
            expected = log_softmax(reference, feature["input_ids"])[
                torch.arange(n - 1, n - 1 + len(seq.tokens)), torch.tensor(seq.tokens)
            ]
            assert (torch.tensor(old_logps) - expected).abs().max() < TOL


def test_prompt_logprobs_with_max_tokens_0_scores_without_generating(tiny_model_dir, reference):
    sampler = TorchSampler(str(tiny_model_dir))
    chat = {"messages": [*TRAJS[0]["messages"], {"role": "assistant", "content": "It is 5."}]}
    (response,) = sampler.sample([chat], SamplingParams(max_tokens=0, prompt_logprobs=3, temperature=1.0))
    ids = response.prompt_token_ids
    encoded = Template(str(tiny_model_dir)).encode(chat["messages"])
    assert ids == encoded["input_ids"]  # the whole conversation, no generation prompt
    (seq,) = response.sequences
    assert seq.tokens == [] and seq.logprobs == []
    assert seq.new_input_feature["labels"] == encoded["labels"]  # the reply stays supervised
    expected = log_softmax(reference, ids)
    assert response.prompt_logprobs[0] is None and response.topk_prompt_logprobs[0] is None
    got = torch.tensor(response.prompt_logprobs[1:])
    assert (got - expected.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)).abs().max() < TOL
    values, indices = expected.topk(3, dim=-1)
    for i, top in enumerate(response.topk_prompt_logprobs[1:]):
        assert [t for t, _ in top] == indices[i].tolist()
        assert torch.allclose(torch.tensor([v for _, v in top]), values[i], atol=TOL)


def test_prompt_logprobs_beside_generation(tiny_model_dir, reference):
    sampler = TorchSampler(str(tiny_model_dir))
    (response,) = sampler.sample(TRAJS[0], SamplingParams(max_tokens=3, prompt_logprobs=1, seed=0))
    assert len(response.sequences[0].tokens) == 3
    ids = response.prompt_token_ids
    expected = log_softmax(reference, ids).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    assert (torch.tensor(response.prompt_logprobs[1:]) - expected).abs().max() < TOL
    assert all(len(top) == 1 for top in response.topk_prompt_logprobs[1:])


def test_unsupported_sampling_params_are_one_line(tiny_model_dir):
    sampler = TorchSampler(str(tiny_model_dir))
    with pytest.raises(UserError, match=r"not supported yet: SamplingParams\(repetition_penalty=1.1\)"):
        sampler.sample(TRAJS[0], SamplingParams(max_tokens=2, repetition_penalty=1.1))
    with pytest.raises(UserError, match="ends with an assistant message; .* or score it with max_tokens=0"):
        sampler.sample(
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}
        )


def test_checkpoint_engine_manager_syncs_into_a_vllm_sampler(make_model, tiny_model_dir):
    model = make_model(init_lora_weights=False)
    sampler = vLLMSampler(model_id=str(tiny_model_dir), engine_args=UPSTREAM_ENGINE_ARGS)
    manager = CheckpointEngineManager(model=model, sampler=sampler)
    assert manager.sync_weights(merge_and_sync=False)["mode"] == "lora"
    params = SamplingParams(max_tokens=5, logprobs=1, seed=2)
    (synced,) = sampler.sample(TRAJS[0], params)
    (trainer,) = TorchSampler(model).sample(TRAJS[0], params)
    assert synced.sequences[0].tokens == trainer.sequences[0].tokens
    a = torch.tensor([lp[0][1] for lp in synced.sequences[0].logprobs])
    b = torch.tensor([lp[0][1] for lp in trainer.sequences[0].logprobs])
    assert (a - b).abs().max() < TOL
    with pytest.raises(
        UserError, match="CheckpointEngineManager\\(platform='TPU'\\): use one of GPU, NPU, CPU"
    ):
        CheckpointEngineManager(model=model, sampler=sampler, platform="TPU")


def test_use_base_model_runs_no_adapter(make_model, tiny_model_dir, reference):
    model = make_model(init_lora_weights=False)
    params = SamplingParams(max_tokens=4, logprobs=1, seed=3)
    own = TorchSampler(str(tiny_model_dir))
    CheckpointEngineManager(model=model, sampler=own).sync_weights()
    for sampler in (own, TorchSampler(model)):
        (base,) = sampler.sample(TRAJS[0], params, use_base_model=True)
        (tuned,) = sampler.sample(TRAJS[0], params)
        seq = base.sequences[0]
        n = len(base.prompt_token_ids)
        ids = seq.new_input_feature["input_ids"]
        expected = log_softmax(reference, ids)[torch.arange(n - 1, len(ids) - 1), torch.tensor(seq.tokens)]
        assert (torch.tensor([lp[0][1] for lp in seq.logprobs]) - expected).abs().max() < TOL
        tuned_seq = tuned.sequences[0]
        ids = tuned_seq.new_input_feature["input_ids"]
        untuned = log_softmax(reference, ids)[
            torch.arange(n - 1, len(ids) - 1), torch.tensor(tuned_seq.tokens)
        ]
        assert (torch.tensor([lp[0][1] for lp in tuned_seq.logprobs]) - untuned).abs().max() > 1e-3
    with pytest.raises(UserError, match="use_base_model=True runs no adapter"):
        own.sample(TRAJS[0], params, adapter_name="default", use_base_model=True)
