"""The service on a tiny Qwen3-MoE base (8 experts, top 2) through the official Tinker SDK. Each
tenant's ``all-linear`` adapter reaches the attention, the router and the fused experts (PEFT's
expert parameters, ``twinkle.model.slot_experts``):

- two tenants train at once on their own rows; each one's losses and saved adapter are those of
  the same steps on an in-process ``MultiLoraTransformersModel`` with Tinker's LoRA;
- the two sample greedily at once, their rows in one decoding batch (each row's expert layers
  run with its own adapter, ``slot_experts.rows_by_adapter``), and each gets what it gets alone;
- a tenant's saved sampler weights load in ``peft`` on the base and give the service's
  log-probs, experts' LoRA included.

Tolerances: training runs the same products in the same layout in and out of the service, so
the summed losses agree to 1e-5 relative and the adapters after Adam steps to 1e-5 (as on the
dense base, ``test_server``), provided every expert of every layer gets some of each window's
tokens. The router's gradient for an expert no token picks is zero but for rounding (the top-k
weights are renormalised over the picked experts); Adam with Tinker's ``eps = 1e-12`` turns it
into a step of the learning rate of either sign, so two runs whose sums round differently part
there. Each tenant's rows reach all experts (``routed`` checks it). Log-probs of two computations
of the model (another batch, PEFT's layers) are within ``chain_tolerances`` of the
model's sums: a Llama's with the experts' widths, plus the router's and the top-k combination
per layer."""

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from peft import LoraConfig
from serving import KEY_A, KEY_B, start
from test_server import assert_same_adapter, datum
from tinker import types
from tolerances import chain_tolerances, llama_sums

from twinkle.loss.token_weighted_ce import TokenWeightedCrossEntropyLoss
from twinkle.model import MultiLoraTransformersModel

sys.path.insert(0, str(Path(__file__).parents[1] / "moe"))  # the tiny MoE builders
from tiny_moe import EXPERTS, SHAPE, TOP_K, build_qwen3_moe  # noqa: E402

LR, STEPS, MAX_LORAS = 1e-2, 3, 4
ROWS = {  # (tokens, weights) of each tenant's rows; the first target of each row is not trained
    KEY_A: [(list(range(5, 17)), [0] + [1] * 10), (list(range(200, 212)), [0] + [1] * 9 + [0.5])],
    KEY_B: [([5, 6, 7, *range(300, 309)], [0, 0] + [1] * 9), (list(range(100, 110)), [0] + [1] * 8)],
}
PROMPT = [5, 6, 7]  # both tenants' rows start with it, and go on differently
MAX_TOKENS = 40


def moe_sums(tokens: int) -> list[int]:
    """The tiny Qwen3-MoE's chain of sums over ``tokens`` tokens: a Llama's with an expert's
    widths, plus per layer the router (hidden) and the weighted top-k (TOP_K), twice each."""
    hidden, layers = SHAPE["hidden_size"], SHAPE["num_hidden_layers"]
    routing = [2 * (hidden + TOP_K)] * layers
    return llama_sums(hidden, SHAPE["moe_intermediate_size"], layers, tokens, vocab=600) + routing


def routed(moe_dir, rows) -> list[set[int]]:
    """Per layer, the experts the base routes some token of ``rows`` to, but a row's last token
    (whose output no loss reads; a token's routing depends on the tokens up to it only)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32)
    chosen: list[set[int]] = [set() for _ in range(SHAPE["num_hidden_layers"])]
    with torch.no_grad():
        for tokens, _ in rows:
            out = model(input_ids=torch.tensor([tokens[:-1]]), output_router_logits=True)
            for layer, logits in zip(chosen, out.router_logits, strict=True):
                layer.update(torch.topk(logits, TOP_K).indices.flatten().tolist())
    return chosen


@pytest.fixture(scope="module")
def moe_dir(tiny_model_dir, tmp_path_factory):
    return build_qwen3_moe(tiny_model_dir, tmp_path_factory.mktemp("qwen3_moe"))


@pytest.fixture(scope="module")
def moe_server(moe_dir, tmp_path_factory):
    torch.manual_seed(0)
    running = start(moe_dir, tmp_path_factory.mktemp("srv"), max_loras=MAX_LORAS)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def trained(moe_server, moe_dir):
    """Both tenants' training clients after ``STEPS`` steps each on their rows, run at once, and
    the summed loss of each step."""
    done: dict[str, tuple] = {}

    def train(key: str) -> None:
        client = tinker.ServiceClient(base_url=moe_server.url, api_key=key)
        tc = client.create_lora_training_client(base_model=str(moe_dir), rank=4, train_unembed=False).result()
        losses = []
        for _ in range(STEPS):
            out = tc.forward_backward([datum(*r) for r in ROWS[key]], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=LR)).result()
            losses.append(out.metrics["loss:sum"])
        done[key] = tc, losses

    threads = [threading.Thread(target=train, args=(key,)) for key in ROWS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert done.keys() == ROWS.keys()
    return done


def local_steps(moe_dir, adapter: str, rows) -> tuple[dict, list[float]]:
    """The same steps in process: Tinker's LoRA (rank 4, alpha 32, every linear layer), the
    token-weighted loss on weights ``T * w`` (the mean over the T trained tokens is then the sum,
    as ``test_server.local_train``), AdamW with the SDK's defaults; (adapter, loss of each step)."""
    from test_server import _batch

    model = MultiLoraTransformersModel(str(moe_dir), max_loras=MAX_LORAS, max_r=8)
    model.add_adapter_to_model(
        adapter, LoraConfig(r=4, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
    )
    model.set_loss(TokenWeightedCrossEntropyLoss(reduction="sum"), adapter_name=adapter)
    model.set_optimizer("AdamW", lr=LR, adapter_name=adapter, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    batch, weights = _batch(rows)
    losses = []
    for _ in range(STEPS):
        losses.append(
            model.forward_backward(batch, adapter_name=adapter, loss_weights=weights * (weights != 0).sum())
        )
        model.clip_grad_norm(0.0, adapter_name=adapter)
        model.step(adapter_name=adapter)
        model.zero_grad(adapter_name=adapter)
    return model.slots.export(adapter), losses


def saved(moe_server, tc, name: str) -> tuple[str, Path]:
    """The tenant's weights saved for sampling as ``name``: (``tinker://`` path, its folder)."""
    path = tc.save_weights_for_sampler(name).result().path
    s = moe_server.app.state.server
    return path, s.registry.folder(s.registry.runs[tc.model_id]) / "sampler_weights" / name


def test_each_tenant_trains_as_the_in_process_model(moe_server, moe_dir, trained):
    from safetensors.torch import load_file

    s = moe_server.app.state.server
    for key, (tc, losses) in trained.items():
        name = s.registry.runs[tc.model_id].adapter
        state = load_file(str(saved(moe_server, tc, "trained")[1] / "adapter_model.safetensors"))
        experts = [k for k in state if ".mlp.experts." in k]
        assert experts and any(".mlp.gate." in k for k in state)  # the experts and the router have LoRA
        assert all(bool(state[k].abs().sum()) for k in experts)  # and it trained
        assert all(len(layer) == EXPERTS for layer in routed(moe_dir, ROWS[key]))  # as the docstring says
        expected_state, expected_losses = local_steps(moe_dir, name, ROWS[key])
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
        assert losses[-1] < losses[0]
        assert_same_adapter(state, expected_state)


def _greedy(sampler) -> object:
    return sampler.sample(
        types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    )


def test_two_tenants_sampling_at_once_get_what_each_gets_alone(moe_server, trained):
    samplers = {key: tc.save_weights_and_get_sampling_client().result() for key, (tc, _) in trained.items()}
    alone = {key: _greedy(sampler).result().sequences[0] for key, sampler in samplers.items()}
    assert list(alone[KEY_A].tokens) != list(alone[KEY_B].tokens)  # the adapters draw differently
    batch = moe_server.app.state.server.engine.core.batch
    widest, step = [], batch._step
    # each step held 10 ms: the first request is still decoding when the second arrives
    batch._step = lambda: (widest.append(len(batch.streams)), time.sleep(0.01), step())[2]
    try:
        futures = {key: _greedy(sampler) for key, sampler in samplers.items()}
        together = {key: f.result().sequences[0] for key, f in futures.items()}
    finally:
        batch._step = step
    assert max(widest) == 2  # the two requests decoded in one batch
    for key, seq in together.items():
        assert list(seq.tokens) == list(alone[key].tokens)
        want = torch.tensor(alone[key].logprobs)
        sums = moe_sums(len(PROMPT) + len(seq.tokens))
        torch.testing.assert_close(torch.tensor(seq.logprobs), want, **chain_tolerances(sums, want))


def test_a_saved_adapter_loads_in_peft_and_gives_the_services_logprobs(moe_server, moe_dir, trained):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tc, _ = trained[KEY_B]
    path, folder = saved(moe_server, tc, "for-peft")
    sampler = tinker.ServiceClient(base_url=moe_server.url, api_key=KEY_B).create_sampling_client(
        model_path=path
    )
    tokens = ROWS[KEY_B][0][0]
    served = torch.tensor(sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:])

    base = AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(folder)).eval()

    def logprobs() -> torch.Tensor:
        with torch.no_grad():
            logits = peft_model(input_ids=torch.tensor([tokens])).logits[0, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]

    ours = logprobs()
    tolerance = chain_tolerances(moe_sums(len(tokens)), ours)
    torch.testing.assert_close(served, ours, **tolerance)
    with torch.no_grad():  # the experts' LoRA is part of what agreed: without it the log-probs move
        for n, p in peft_model.named_parameters():
            if ".mlp.experts." in n and "lora_B" in n:
                p.zero_()
    moved = (logprobs() - ours).abs().max()
    assert moved > 10 * (tolerance["atol"] + tolerance["rtol"] * ours.abs().max())
