"""``prompt_alt_tokens_k`` and a sparse ``target_prompt_logprobs`` through the official SDK: the
draws are the model's, at the request's temperature, reproducible by seed; a sparse request is
answered in its own layout; bad values are a 400 naming the limit."""

import httpx
import numpy as np
import pytest
import tinker
import torch
from serving import KEY_A
from test_tinker_parity import _reference_logps
from tinker import types

PROMPT = [5, 6, 7, 8, 9]
V1 = "/api/v1"


def _sampler(server, tiny_model_dir):
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    return client.create_sampling_client(base_model=str(tiny_model_dir)).result()


def _draws(sampler, k: int, temperature: float, seed: int, **extra) -> tuple[np.ndarray, np.ndarray, object]:
    out = sampler.sample(
        types.ModelInput.from_ints(PROMPT),
        1,
        types.SamplingParams(max_tokens=1, temperature=temperature, seed=seed),
        prompt_alt_tokens_k=k,
        **extra,
    ).result()
    alt = out.prompt_alt_tokens
    assert alt.tokens.dtype == "int64" and alt.logprobs.dtype == "float32"
    assert alt.tokens.shape == alt.logprobs.shape == [len(PROMPT) - 1, k]
    return alt.tokens.to_numpy(), alt.logprobs.to_numpy(), out


def test_alternative_tokens_are_the_models_draws(server, tiny_model_dir):
    sampler = _sampler(server, tiny_model_dir)
    vocab = server.app.state.server.engine.vocab
    ids, logps, out = _draws(sampler, 8, 1.0, 11, topk_prompt_logprobs=vocab)
    ref = _reference_logps(server, tiny_model_dir, PROMPT)[:-1]  # row i: the distribution of PROMPT[i + 1]
    np.testing.assert_allclose(logps, ref.gather(1, torch.from_numpy(ids)).numpy(), atol=1e-4, rtol=0)
    for i in range(len(PROMPT) - 1):  # the same numbers as the request's own full top-k (same forward)
        full = dict(out.topk_prompt_logprobs[i + 1])
        np.testing.assert_allclose(logps[i], [full[t] for t in ids[i]], atol=1e-6, rtol=0)

    again, again_logps, _ = _draws(sampler, 8, 1.0, 11)
    assert (again == ids).all() and (again_logps == logps).all()  # the seed fixes the draws
    other, _, _ = _draws(sampler, 8, 1.0, 12)
    assert (other != ids).any()

    argmax = ref.argmax(dim=-1, keepdim=True).expand(-1, 3).numpy()
    for temperature in (1e-6, 0.0):
        cold, cold_logps, _ = _draws(sampler, 3, temperature, 5)
        assert (cold == argmax).all()
        np.testing.assert_allclose(cold_logps, ref.max(dim=-1, keepdim=True).values.expand(-1, 3), atol=1e-4)

    one = sampler.sample(
        types.ModelInput.from_ints([5]), 1, types.SamplingParams(max_tokens=1), prompt_alt_tokens_k=2
    ).result()
    assert one.prompt_alt_tokens.tokens.shape == [0, 2] and one.prompt_alt_tokens.tokens.to_numpy().size == 0


@pytest.mark.parametrize("temperature", [1.0, 0.05])
def test_draws_follow_the_tempered_distribution(server, tiny_model_dir, temperature):
    """The mean model log-prob of 1024 draws per position is its expectation under
    softmax(logits / T), within 5 standard errors; at T = 0.05 it differs from T = 1's."""
    sampler = _sampler(server, tiny_model_dir)
    _, logps, _ = _draws(sampler, 1024, temperature, 3)
    ref = _reference_logps(server, tiny_model_dir, PROMPT)[:-1].double()
    tempered = (ref / temperature).softmax(dim=-1)
    mean = (tempered * ref).sum(dim=-1)
    std = ((tempered * (ref - mean[:, None]) ** 2).sum(dim=-1)).sqrt()
    error = (torch.from_numpy(logps).double().mean(dim=-1) - mean).abs()
    assert (error < 5 * std / 1024**0.5).all(), (error, std)
    if temperature != 1.0:
        at_one = ((ref.softmax(dim=-1)) * ref).sum(dim=-1)
        assert ((mean - at_one) > 10 * std / 1024**0.5).all()  # the test tells the two apart


def test_a_sparse_target_is_answered_sparse(server, tiny_model_dir):
    sampler = _sampler(server, tiny_model_dir)
    ids = torch.full((len(PROMPT) - 1, 3), -1, dtype=torch.int64)
    ids[1, 0], ids[3, 2] = 42, 7
    target = types.TensorData.from_torch_sparse(ids, pad_value=-1)
    assert target.sparse_crow_indices is not None
    out = sampler.sample(
        types.ModelInput.from_ints(PROMPT),
        1,
        types.SamplingParams(max_tokens=1),
        target_prompt_logprobs=target,
    ).result()
    got = out.target_prompt_logprobs
    assert got.dtype == "float32" and got.shape == [len(PROMPT) - 1, 3]
    assert got.sparse_crow_indices == target.sparse_crow_indices
    assert got.sparse_col_indices == target.sparse_col_indices
    ref = _reference_logps(server, tiny_model_dir, PROMPT)
    expected = torch.zeros(len(PROMPT) - 1, 3)
    expected[1, 0], expected[3, 2] = ref[1, 42], ref[3, 7]
    torch.testing.assert_close(got.to_torch(pad_value=0), expected, atol=1e-4, rtol=0)

    # a listed cell of -1 asks for nothing: 0.0 there, the layout kept
    listed = types.TensorData(
        data=[-1, 42],
        dtype="int64",
        shape=[4, 3],
        sparse_crow_indices=[0, 1, 2, 2, 2],
        sparse_col_indices=[2, 0],
    )
    out = sampler.sample(
        types.ModelInput.from_ints(PROMPT),
        1,
        types.SamplingParams(max_tokens=1),
        target_prompt_logprobs=listed,
    ).result()
    assert out.target_prompt_logprobs.sparse_col_indices == [2, 0]
    np.testing.assert_allclose(
        out.target_prompt_logprobs.to_numpy(pad_value=0)[:2], [[0, 0, 0], [ref[1, 42], 0, 0]], atol=1e-4
    )


def _asample(server, tiny_model_dir, **fields) -> httpx.Response:
    body = {
        "base_model": str(tiny_model_dir),
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": {"max_tokens": 1},
        **fields,
    }
    return httpx.post(f"{server.url}{V1}/asample", json=body, headers={"X-API-Key": KEY_A})


def test_bad_draw_counts_and_sparse_layouts_are_a_400(server, tiny_model_dir):
    sparse = {"dtype": "int64", "shape": [4, 3], "data": [42, 7]}
    cases = [
        ({"prompt_alt_tokens_k": 1025}, "prompt_alt_tokens_k must be 0..1024"),
        ({"prompt_alt_tokens_k": -1}, "prompt_alt_tokens_k must be 0..1024"),
        ({"sampling_params": {"max_tokens": 1, "temperature": -0.5}}, "temperature must be 0"),
        (
            {
                "target_prompt_logprobs": {
                    **sparse,
                    "sparse_crow_indices": [0, 1, 2],
                    "sparse_col_indices": [0, 2],
                }
            },
            "sparse_crow_indices must be 5",
        ),
        (
            {
                "target_prompt_logprobs": {
                    **sparse,
                    "sparse_crow_indices": [0, 0, 2, 2, 2],
                    "sparse_col_indices": [2, 0],
                }
            },
            "sorted and distinct",
        ),
        (
            {
                "target_prompt_logprobs": {
                    **sparse,
                    "sparse_crow_indices": [0, 1, 1, 1, 2],
                    "sparse_col_indices": [0, 3],
                }
            },
            "columns in [0, 3)",
        ),
        ({"target_prompt_logprobs": {**sparse, "sparse_crow_indices": [0, 1, 1, 1, 2]}}, "send both"),
    ]
    for fields, expect in cases:
        r = _asample(server, tiny_model_dir, **fields)
        assert r.status_code == 400 and expect in r.json()["detail"], (fields, r.text)
