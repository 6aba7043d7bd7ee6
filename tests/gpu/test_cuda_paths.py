"""What users run on a GPU, end to end through the model's own loss path: kernelized models
(RMSNorm, the one-node MLP and q/k/v, the fused LoRA linears) on packed rows with the fused
linear cross-entropy, in bf16, with fp32 and with bf16 adapters; the torch-only chain (Liger
hidden in this process) and the Liger chain, both with backward; LoRA dropout's masks on CUDA;
``BatchedMuon`` against ``torch.optim.Muon``; FSDP2 on Twinkle's path (segments, fused CE,
``ReplicatedOptimizer``, the empty-shard pad batch) on one rank and on two; and that no
CPU-only helper is reached on CUDA.

Each compares with an unkernelized reference (PEFT's modules, the full-logits loss) to bf16
rounding: loss within 2%, every gradient at a cosine above 0.99 and within 10% of its norm (a
wrong gradient is off by ~100%). CI has no GPU, so these skip there; ``TWINKLE_GPU_TEST_DEVICE=cpu``
runs the device-neutral ones on the CPU, to check the tests themselves."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from masks import record, replay
from peft import LoraConfig

from twinkle.kernel import cpu_gemm as gemm
from twinkle.kernel import kernelize, registry, switched
from twinkle.kernel.attention import batched, native, packed, pooled
from twinkle.kernel.lora import dropout
from twinkle.kernel.muon import BatchedMuon
from twinkle.model import TransformersModel

sys.path.insert(0, str(Path(__file__).parent))
import fsdp_worker  # noqa: E402

DEVICE = os.environ.get("TWINKLE_GPU_TEST_DEVICE", "cuda")
ON_CUDA = DEVICE == "cuda"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        ON_CUDA and not torch.cuda.is_available(),
        reason="needs a CUDA device: these run the CUDA paths (kernelized bf16 models, Liger, FSDP2 with nccl)",
    ),
]
HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def batch(tiny_model_dir):
    return fsdp_worker.share(fsdp_worker.global_batch(tiny_model_dir), 0, 8, 0, 1)


@pytest.fixture
def chain(request, monkeypatch):
    """``torch``: Liger hidden in this process, as on a machine without it (the import fails and
    the availability check says no); ``liger``: the default chain, which takes Liger on CUDA."""
    name = request.param
    if name == "liger" and not (ON_CUDA and HAS_LIGER):
        pytest.skip("the Liger chain needs CUDA and liger_kernel installed")
    if name == "torch":
        for module in [m for m in sys.modules if m == "liger_kernel" or m.startswith("liger_kernel.")]:
            monkeypatch.delitem(sys.modules, module)
        monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import fails, find_spec is None
    registry.forget()
    yield name
    monkeypatch.undo()
    registry.forget()


def _model(
    model_dir, *, kernels: bool, adapters: torch.dtype = torch.float32, p: float = 0.0, packed_rows=True
):
    model = TransformersModel(str(model_dir), dtype=torch.bfloat16, padding_free=packed_rows)
    fsdp_worker.spread_norms(model.model)
    if kernels:
        kernelize(model)
    torch.manual_seed(0)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=p, init_lora_weights=False
    )
    model.add_adapter_to_model("default", config)
    with torch.no_grad():
        for name, param in model.model.named_parameters():
            if "lora_" in name:
                param.data = param.data.to(adapters)
    return model


def _nodes(root) -> set[str]:
    """The autograd node classes of a graph."""
    seen, stack, names = set(), [root], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(n for n, _ in node.next_functions)
    return names


def _step(model: TransformersModel, batch, task: str):
    """One micro-batch's forward and backward: loss, every gradient, the graph's node classes."""
    model.forward(inputs=batch, task=task)
    out = model._pending_backward[1]
    nodes = _nodes(out.loss_sum.grad_fn)
    loss = model.backward()
    grads = {n: p.grad.float().clone() for n, p in model.model.named_parameters() if p.grad is not None}
    return loss, grads, nodes


def _reference(model_dir, batch, adapters: torch.dtype, packed_rows=False, p: float = 0.0, drawn=None):
    """PEFT's own modules, no kernel, the full logits."""
    model = _model(model_dir, kernels=False, adapters=adapters, p=p, packed_rows=packed_rows)
    queue = replay(model.model, drawn) if drawn is not None else None
    with switched({"TWINKLE_FUSED_LORA": "off"}):
        loss, grads, nodes = _step(model, batch, "causal_lm")
    assert not any(n.startswith("_Lora") for n in nodes), nodes
    if queue is not None:
        assert not queue, f"{len(queue)} recorded masks were not used"
    return loss, grads


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach(), expected.detach()
    return float((actual.float() - expected.float()).norm() / expected.float().norm().clamp(min=1e-30))


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().float(), b.flatten().float(), dim=0))


def _assert_bf16_close(loss, grads, loss_ref, grads_ref):
    assert torch.isfinite(torch.tensor(loss)) and abs(loss - loss_ref) < 2e-2 * abs(loss_ref), (
        loss,
        loss_ref,
    )
    assert grads.keys() == grads_ref.keys() and grads_ref
    for name, expected in grads_ref.items():
        actual = grads[name]
        assert actual.dtype == expected.dtype
        assert _cosine(actual, expected) > 0.99, (name, _cosine(actual, expected))
        assert _relative_error(actual, expected) < 0.1, (name, _relative_error(actual, expected))


@pytest.mark.parametrize("adapters", [torch.float32, torch.bfloat16], ids=["fp32-adapters", "bf16-adapters"])
@pytest.mark.parametrize("chain", ["torch", "liger"], indirect=True)
def test_kernelized_packed_fused_ce_equals_the_plain_model(tiny_model_dir, batch, chain, adapters):
    """The whole kernelized model through ``compute_loss`` (packed row, fused CE) against PEFT's
    modules on the padded batch with the full logits: loss and every LoRA gradient."""
    model = _model(tiny_model_dir, kernels=True, adapters=adapters)
    marks = {getattr(m, "_twinkle_kernel", None) for m in model.model.modules()} - {None}
    backend = "liger" if chain == "liger" else "torch"
    assert {("rms_norm", backend), ("swiglu_mlp", backend), ("lora_attention", "torch")} <= marks, marks
    loss, grads, nodes = _step(model, batch, "fused_lm_ce")
    # what ran: the one-node MLP and LoRA linears; q/k/v as one node where the adapters are in
    # the base's dtype (bf16: the case the bf16 FSDP policy creates)
    assert {"_LoraMLPBackward", "_LoraLinearBackward"} <= nodes, nodes
    assert ("_LoraQKVBackward" in nodes) == (adapters == torch.bfloat16), nodes
    assert ("RMSNormFunctionBackward" in nodes) == (chain == "torch"), nodes
    assert not any("Liger" in n for n in nodes) if chain == "torch" else any("Liger" in n for n in nodes), (
        nodes
    )
    _assert_bf16_close(loss, grads, *_reference(tiny_model_dir, batch, adapters))


@pytest.fixture
def cpu_helper_calls(monkeypatch):
    """Calls into every CPU-only helper (the calls still run): oneDNN's products, packing and
    measurements, the C attention kernel, pooled and batched attention, the dropout C kernel."""
    calls: dict[str, int] = {}

    def spy(owner, name):
        real = getattr(owner, name)
        calls[f"{owner.__name__}.{name}"] = 0

        def counted(*args, **kwargs):
            calls[f"{owner.__name__}.{name}"] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    for owner, name in [
        (gemm, "_linear_pointwise"),
        (gemm, "_pack"),
        (gemm, "_measure"),
        (native, "library"),
        (native, "native_attention"),
        (pooled, "pool"),
        (pooled, "pooled_rows"),
        (batched, "batched_attention"),
        (dropout, "_library"),
    ]:
        spy(owner, name)
    return calls


@pytest.mark.parametrize("chain", ["torch"], indirect=True)
def test_dropout_in_the_kernelized_model_equals_peft_with_the_same_masks(
    tiny_model_dir, batch, chain, monkeypatch, cpu_helper_calls
):
    """The contract's LoRA dropout (0.05) on CUDA: the nodes' masks come from dropout.py's torch
    ops (the C kernel is never asked), and PEFT given the same masks (``keep_mask``) gives the
    same loss and gradients, on the same packed row. No CPU-only helper runs in the step."""
    attention_calls = []
    real_attention = packed.segment_attention
    monkeypatch.setattr(
        packed, "segment_attention", lambda *a, **k: attention_calls.append(1) or real_attention(*a, **k)
    )
    mask_devices = []
    real_mask = dropout.keep_mask
    monkeypatch.setattr(
        dropout,
        "keep_mask",
        lambda shape, drop, device="cpu": (
            mask_devices.append(torch.device(device).type) or real_mask(shape, drop, device)
        ),
    )
    model = _model(tiny_model_dir, kernels=True, p=0.05)
    drawn = record(monkeypatch)
    loss, grads, _ = _step(model, batch, "fused_lm_ce")
    assert len(drawn) == 7 * 2  # q k v o gate up down, two layers
    assert attention_calls, "the step ran no packed attention"
    if ON_CUDA:  # on the CPU the C kernels are the point; there only the comparison below runs
        assert mask_devices and set(mask_devices) == {"cuda"}, mask_devices
        assert not any(cpu_helper_calls.values()), cpu_helper_calls
    monkeypatch.setattr(dropout, "keep_mask", real_mask)
    _assert_bf16_close(loss, grads, *_reference(tiny_model_dir, batch, torch.float32, True, 0.05, drawn))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_masks_on_the_device_are_keep_mask_and_the_cpu_kernels(dtype):
    """``apply``, ``masked_low`` and ``masked_input_grads`` on the device equal their CPU
    results (the C kernel where built, in fp32) and keep exactly ``keep_mask``'s elements."""
    torch.manual_seed(0)
    x = torch.randn(300, 577).to(dtype)
    drop = dropout.draw(0.05)
    on_device = dropout.apply(x.to(DEVICE), drop)
    assert on_device.device.type == DEVICE
    assert torch.equal((on_device != 0).cpu(), dropout.keep_mask(x.shape, drop) & (x != 0))
    torch.testing.assert_close(on_device.cpu(), dropout.apply(x, drop), rtol=0, atol=0)
    a, g = torch.randn(8, 577).to(dtype), torch.randn(300, 8)
    low, bits = dropout.masked_low(x.to(DEVICE), a.to(DEVICE), (drop,))
    if DEVICE != "cpu":
        assert bits is None  # off the CPU the mask is recomputed from its seed, nothing kept
    torch.testing.assert_close(low.cpu(), dropout.masked_low(x, a, (drop,))[0], rtol=2e-2, atol=2e-2)
    grad_x = torch.zeros(300, 577, dtype=dtype, device=DEVICE)
    grad_a = dropout.masked_input_grads(
        x.to(DEVICE), a.to(DEVICE), g.to(DEVICE).to(dtype), (drop,), grad_x, True
    )
    expected_x = torch.zeros(300, 577, dtype=dtype)
    expected_a = dropout.masked_input_grads(x, a, g.to(dtype), (drop,), expected_x, True)
    tol = dict(rtol=2e-2, atol=5e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad_a.cpu(), expected_a, **tol)
    torch.testing.assert_close(grad_x.cpu(), expected_x, **tol)


def test_batched_muon_on_the_device_equals_torchs_muon():
    """``BatchedMuon`` (what ``set_optimizer("Muon")`` builds) on CUDA against
    ``torch.optim.Muon``: four steps on LoRA-shaped matrices, the contract's arguments. Both
    orthogonalise in bf16; batched products may round apart, so each matrix's total change is
    compared: within 2% of its norm (a wrong update is off by ~100%)."""
    shapes = [(8, 576)] * 6 + [(8, 1536), (576, 8), (192, 8), (192, 8), (1536, 8)]
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(s, device=DEVICE) * 0.02) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    start = [p.detach().clone() for p in ours]
    kwargs = {"lr": 1e-3, "adjust_lr_fn": "match_rms_adamw"}
    pairs = [(ours, BatchedMuon(ours, **kwargs)), (theirs, torch.optim.Muon(theirs, **kwargs))]
    for _ in range(4):
        grads = [torch.randn_like(p) for p in ours]
        for params, optimizer in pairs:
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad.clone()
            optimizer.step()
    for a, b, s in zip(ours, theirs, start, strict=True):
        assert a.device.type == DEVICE and torch.isfinite(a).all()
        assert _relative_error(a - s, b - s) < 2e-2, (tuple(s.shape), _relative_error(a - s, b - s))


def _assert_same_update(result: dict, reference: dict) -> None:
    assert result["stepped"] and reference["stepped"]
    assert result["optimizer"] == reference["optimizer"] == "BatchedMuon"
    assert abs(result["grad_norm"] - reference["grad_norm"]) < 2e-2 * reference["grad_norm"]
    assert result["updated"].keys() == reference["updated"].keys() and reference["updated"]
    for name, expected in reference["updated"].items():
        torch.testing.assert_close(result["initial"][name], reference["initial"][name])
        change, change_ref = (
            result["updated"][name] - result["initial"][name],
            expected - reference["initial"][name],
        )
        assert _cosine(change, change_ref) > 0.99, (name, _cosine(change, change_ref))
        assert _relative_error(change, change_ref) < 0.1, (name, _relative_error(change, change_ref))


def test_fsdp2_on_one_rank_takes_the_same_step_as_the_unsharded_model(tiny_model_dir):
    """Twinkle's FSDP2 path on a 1-rank mesh (a training world of one never shards, so this
    shards the model as ``add_adapter_to_model`` does in a world of two): packed rows, the fused
    CE, Muon on the full copies of ``ReplicatedOptimizer``, then the same update as unsharded."""
    import torch.distributed as dist

    from twinkle.distributed.fsdp import release_process_groups

    reference = fsdp_worker.train(tiny_model_dir)
    assert not reference["replicated"] and not reference["sharded"]
    dist.init_process_group("nccl" if ON_CUDA else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        result = fsdp_worker.train(tiny_model_dir, shard_one_rank=True)
    finally:
        dist.destroy_process_group()
        release_process_groups()
    assert result["sharded"] and result["replicated"]
    assert result["rows"] == reference["rows"] == [8, 1]
    _assert_same_update(result, reference)


@pytest.mark.skipif(
    ON_CUDA and (not torch.cuda.is_available() or torch.cuda.device_count() < 2),
    reason=f"needs 2 CUDA devices for FSDP2 over nccl; this machine has "
    f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}",
)
def test_fsdp2_on_two_ranks_takes_the_same_step_as_one_process(tmp_path, tiny_model_dir):
    """Two ranks under torchrun with nccl (gloo with ``TWINKLE_GPU_TEST_DEVICE=cpu``): each shards the model, trains on its half of the rows,
    and rank 1's share of the last micro-batch is empty (it runs the pad batch); the update equals
    one process's on all the rows."""
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"),
        *(str(Path(fsdp_worker.__file__)), "--model-dir", str(tiny_model_dir), "--out", str(tmp_path)),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [r["rows"] for r in ranks] == [[4, 1], [4, 0]]
    assert all(r["sharded"] and r["replicated"] for r in ranks)
    for name, weight in ranks[0]["updated"].items():
        assert torch.equal(ranks[1]["updated"][name], weight), name  # every rank holds the same weights
    _assert_same_update(ranks[0], fsdp_worker.train(tiny_model_dir))
