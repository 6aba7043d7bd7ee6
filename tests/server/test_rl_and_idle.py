"""The policy losses through the SDK, an idle run parked and resumed, ``metrics.jsonl`` and its
TensorBoard copy (``--report-to tensorboard``)."""

import json
import math
import time

import numpy as np
import pytest
import tinker
import torch
from serving import KEY_A, start
from test_server import ROWS, adapter_of, assert_same_adapter, datum, local_train
from tinker import types

from twinkle.loss.base import LossView
from twinkle.server.losses import TinkerLoss


def _view(logits, targets, **extras) -> LossView:
    return LossView(
        targets=torch.tensor(targets),
        logits=torch.tensor(logits),
        extras={k: torch.tensor(v) for k, v in extras.items()},
    )


def test_policy_losses_by_hand():
    logits = [[0.0, math.log(3.0)], [math.log(3.0), 0.0]]  # p(target 1) = 0.75, p(target 1) = 0.25
    logp = [math.log(0.75), math.log(0.25)]
    old = [logp[0] - 0.5, logp[1] + 0.5]  # ratios e^0.5 (1.6487) and e^-0.5 (0.6065)
    adv = [1.0, -2.0]
    out = TinkerLoss("importance_sampling", {}).compute(_view(logits, [1, 1], old_logps=old, advantages=adv))
    expected = -(math.exp(0.5) * 1.0 + math.exp(-0.5) * -2.0)
    assert out.loss_sum.item() == pytest.approx(expected, abs=1e-5) and out.num_tokens == 2
    ppo = TinkerLoss("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    out = ppo.compute(_view(logits, [1, 1], old_logps=old, advantages=adv))
    # A>0: min(1.6487, 1.2) * 1 = 1.2; A<0: min(0.6065 * -2, 0.8 * -2) = -1.6
    assert out.loss_sum.item() == pytest.approx(-(1.2 - 1.6), abs=1e-5)
    ce = TinkerLoss("cross_entropy", {}).compute(_view(logits, [1, 1], tinker_weights=[0.0, 2.0]))
    assert ce.loss_sum.item() == pytest.approx(-2 * logp[1], abs=1e-5) and ce.num_tokens == 1


@pytest.mark.parametrize("kind", ["cross_entropy", "ppo"])
def test_uncounted_tokens_are_scored_without_a_graph_and_change_nothing(kind, monkeypatch):
    """Tokens of weight (advantage) 0 are scored in chunks without a graph: their log-probs,
    the per-token losses, the loss and the hidden states' gradient equal one pass with a graph
    over every token (the head and the loss are the same fp32 ops on the same rows)."""
    import twinkle.server.losses as losses

    monkeypatch.setattr(losses, "CHUNK", 3)  # several chunks
    torch.manual_seed(0)
    n, width, vocab = 10, 8, 32
    hidden = torch.randn(n, width, requires_grad=True)
    weight, targets = torch.randn(vocab, width), torch.randint(0, vocab, (n,))
    counted = torch.tensor([0, 1, 1, 0, 0, 1, 0, 0, 1, 0], dtype=torch.bool)
    if kind == "cross_entropy":
        extras = {"tinker_weights": counted.float() * 1.5}
    else:
        extras = {"old_logps": -torch.rand(n) * 4, "advantages": counted.float() * torch.randn(n)}
    loss = TinkerLoss(kind, {})
    out = loss.compute(LossView(targets=targets, hidden=hidden, weight=weight, extras=extras))
    out.loss_sum.backward()
    split_grad = hidden.grad.clone()
    hidden.grad = None
    logps = -torch.nn.functional.cross_entropy(hidden @ weight.T, targets, reduction="none")
    if kind == "cross_entropy":
        per_token = -logps * extras["tinker_weights"]
    else:
        per_token = loss.policy.objective(torch.exp(logps - extras["old_logps"]), extras["advantages"])
    per_token.sum().backward()
    assert torch.allclose(loss.last_logps, logps.detach(), atol=1e-5, rtol=0)  # fp32, logps ~ -10
    assert torch.allclose(loss.last_per_token, per_token.detach(), atol=1e-5, rtol=0)
    assert out.loss_sum.item() == pytest.approx(per_token.sum().item(), abs=1e-5)
    assert torch.allclose(split_grad, hidden.grad, atol=1e-5, rtol=0)
    assert not split_grad[~counted].any() and out.num_tokens == int(counted.sum())


def test_rows_at_one_packed_position_are_scored_once_with_the_same_logps(monkeypatch):
    """A scored shared prefix repeats rows (``LossView.positions``): the uncounted ones are
    scored once per position and copied back, equal to scoring every row."""
    import twinkle.server.losses as losses

    monkeypatch.setattr(losses, "CHUNK", 2)
    torch.manual_seed(1)
    positions = torch.tensor([0, 1, 2, 3, 0, 1, 4, 5, 0, 1, 6])
    hidden, weight = torch.randn(7, 8)[positions], torch.randn(16, 8)
    targets = torch.randint(0, 16, (7,))[positions]
    weights = torch.tensor([0, 0, 1, 1, 0, 0, 0, 1, 0, 0, 1], dtype=torch.float32)
    runs = []
    for pos in (positions, None):
        loss = TinkerLoss("cross_entropy", {})
        view = LossView(targets=targets, hidden=hidden, weight=weight, extras={"tinker_weights": weights})
        view.positions = pos
        loss.compute(view)
        runs.append(loss.last_logps)
    assert torch.equal(runs[0][positions == 0], runs[0][positions == 0][:1].expand(3))
    assert torch.allclose(runs[0], runs[1], atol=1e-5, rtol=0)


def test_an_importance_sampling_step_at_ratio_one_is_the_weighted_cross_entropy_step(
    server, tiny_model_dir, tmp_path
):
    """At ratio 1 the gradient of -exp(logp - old) * A is -A * grad(logp), that of -w * logp
    with w = A: one step of each from the same start ends at the same adapter."""
    tokens, adv = ROWS["a"][0][0], [0.0, 0.5, -1.0, 2.0, 1.0]
    other = start(tiny_model_dir, tmp_path / "other")
    try:
        states = []
        for running, loss in ((server, "cross_entropy"), (other, "importance_sampling")):
            tc = (
                tinker.ServiceClient(base_url=running.url, api_key=KEY_A)
                .create_lora_training_client(base_model=str(tiny_model_dir), rank=4, train_unembed=False)
                .result()
            )
            d = datum(tokens, adv)
            if loss == "importance_sampling":
                now = tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
                d = types.Datum(
                    model_input=d.model_input,
                    loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": now, "advantages": adv},
                )
            out = tc.forward_backward([d], loss).result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            states.append(adapter_of(running, tc.model_id)[1])
            if loss == "importance_sampling":  # ratio 1: the loss is -sum(A)
                assert out.metrics["loss:sum"] == pytest.approx(-sum(adv), abs=1e-4)
        assert_same_adapter(states[1], states[0])
    finally:
        other.stop()


def test_an_idle_run_is_parked_and_resumes_where_it_was(tiny_model_dir, tmp_path):
    from serving import Running, free_port

    from twinkle.server import ServerConfig, create_app
    from twinkle.server.state import Limits

    config = ServerConfig(
        model_id=str(tiny_model_dir),
        max_loras=2,
        max_r=8,
        output_dir=tmp_path / "srv",
        keys={KEY_A: Limits()},
        idle_timeout=0.3,
    )
    running = Running(create_app(config), free_port())
    try:
        tc = (
            tinker.ServiceClient(base_url=running.url, api_key=KEY_A)
            .create_lora_training_client(base_model=str(tiny_model_dir), rank=4, train_unembed=False)
            .result()
        )
        losses = []
        for step in range(2):
            out = tc.forward_backward([datum(*r) for r in ROWS["a"]], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            losses.append(out.metrics["loss:sum"])
            if step == 0:
                s = running.app.state.server
                deadline = time.monotonic() + 10
                while s.registry.runs[tc.model_id].live and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert s.registry.runs[tc.model_id].parked is not None
                assert s.engine.free_slots() == 2  # its slot was given back
        s.config.idle_timeout = float("inf")  # read the slot as trained: no second parking from here
        s.queue.call(lambda: None)  # after a parking already under way on the model's thread
        if not s.registry.runs[tc.model_id].live:  # parked again already: a forward loads it back
            tc.forward([datum(*r) for r in ROWS["a"]], "cross_entropy").result()
        assert s.registry.runs[tc.model_id].live
        name, state = adapter_of(running, tc.model_id)
        expected_state, expected_losses = local_train(tiny_model_dir, name, ROWS["a"], steps=2)
        np.testing.assert_allclose(losses, expected_losses, atol=1e-5, rtol=0)
        assert_same_adapter(state, expected_state)
        lines = (
            running.app.state.server.registry.folder(s.registry.runs[tc.model_id]) / "metrics.jsonl"
        ).read_text()
        ops = [json.loads(line)["op"] for line in lines.splitlines()]
        assert [op for op in ops if op != "forward"] == ["forward_backward", "optim_step"] * 2
    finally:
        running.stop()


def test_report_to_tensorboard_writes_each_runs_metrics(tiny_model_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    running = start(tiny_model_dir, tmp_path / "srv", report_to=("tensorboard",))
    try:
        tc = (
            tinker.ServiceClient(base_url=running.url, api_key=KEY_A)
            .create_lora_training_client(base_model=str(tiny_model_dir), rank=4, train_unembed=False)
            .result()
        )
        for _ in range(2):
            tc.forward_backward([datum(*r) for r in ROWS["a"]], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        s = running.app.state.server
        folder = s.registry.folder(s.registry.runs[tc.model_id])
    finally:
        running.stop()
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(folder / "tensorboard"))
    events.Reload()
    for op, name in (("forward_backward", "loss:sum"), ("optim_step", "grad_norm")):
        logged = [(e.step, e.value) for e in events.Scalars(f"{op}/{name}")]
        expected = [(i + 1, r[name]) for i, r in enumerate(x for x in records if x["op"] == op)]
        assert [s for s, _ in logged] == [s for s, _ in expected] == [1, 2]
        np.testing.assert_allclose([v for _, v in logged], [v for _, v in expected], rtol=1e-6)
