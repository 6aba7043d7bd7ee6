"""On-policy GKD on a CPU holds each model's frozen weights once: the student, whose sampler
decodes from its dense weights, keeps no oneDNN-packed copy once a ``TorchSampler`` shares it
(``cpu_gemm.keep_dense``), and its products then run from the dense weights; a teacher that only
scores holds its weights once too. Memory is counted as bytes held (distinct parameter storages
plus packed copies of them), not as resident memory, so the checks do not depend on the
allocator."""

import gc

import pytest
import torch
from peft import LoraConfig
from tolerances import assert_matmul

from twinkle.data_format import SamplingParams
from twinkle.kernel import cpu_gemm as gemm
from twinkle.kernel import registry, set_switches
from twinkle.loss import GKDLoss
from twinkle.model import TransformersModel
from twinkle.model.teacher import teacher_topk
from twinkle.sampler import TorchSampler

pytestmark = pytest.mark.skipif(
    not registry.is_available("cpu_gemm", "packed"), reason="torch built without oneDNN weight packing"
)

PROMPTS = [
    {"messages": [{"role": "user", "content": "Who are you?"}]},
    {"messages": [{"role": "user", "content": "twinkle Paris"}]},
]


@pytest.fixture(autouse=True)
def _packing_on(monkeypatch):
    """Every frozen fp32 product to oneDNN (whichever library is faster here), no copy yet."""
    set_switches({"TWINKLE_ONEDNN": "on", "TWINKLE_PACKED_WEIGHTS": "on"})
    registry.forget()
    monkeypatch.setattr(gemm, "_packed", {})
    monkeypatch.setattr(gemm, "_dense_only", {})
    yield
    registry.forget()


def frozen_weights(model: TransformersModel) -> list[torch.Tensor]:
    return [
        m.weight
        for m in model.model.modules()
        if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad
    ]


def packed_copy_bytes(model: TransformersModel) -> int:
    ids = {id(p) for p in model.model.parameters()}
    return sum(
        entry[3].nbytes for key, entry in gemm._packed.items() if key in ids and entry[0]() is not None
    )


def held_bytes(model: TransformersModel) -> int:
    """The bytes of the model's distinct parameter storages (a tied head counted once) and of
    the packed copies made of them."""
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.model.parameters()
    }
    return sum(storages.values()) + packed_copy_bytes(model)


def weight_bytes(model: TransformersModel) -> int:
    return sum(
        {
            p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.model.parameters()
        }.values()
    )


def test_a_sampler_sharing_the_student_leaves_its_frozen_weights_held_once(make_model):
    student = make_model()
    frozen = frozen_weights(student)
    # what the student holds before a sampler shares it: each frozen weight twice
    assert packed_copy_bytes(student) == sum(w.nbytes for w in frozen) > 0
    assert held_bytes(student) == weight_bytes(student) + sum(w.nbytes for w in frozen)

    TorchSampler(student)
    assert packed_copy_bytes(student) == 0
    assert held_bytes(student) == weight_bytes(student)
    # an adapter added later packs none of the weights the sampler decodes from
    student.add_adapter_to_model("second", LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    assert packed_copy_bytes(student) == 0


def test_the_step_runs_from_the_dense_weights(make_model, tiny_model_dir, monkeypatch):
    student = make_model()
    sampler = TorchSampler(student)
    teacher = TransformersModel(str(tiny_model_dir))  # frozen: no adapter, no optimizer
    student.set_loss(GKDLoss(beta=0.5, topk=8))
    weights, real = [], gemm._linear_pointwise

    def spy(x, w, bias):
        weights.append(w)
        return real(x, w, bias)

    monkeypatch.setattr(gemm, "_linear_pointwise", spy)
    responses = sampler.sample(PROMPTS, SamplingParams(max_tokens=5, num_samples=2, seed=3))
    rows = [s.new_input_feature for r in responses for s in r.sequences]
    loss = student.forward_backward(inputs=rows, **teacher_topk(teacher, rows, 8))
    student.clip_grad_and_step()
    assert torch.isfinite(torch.tensor(float(loss)))
    if registry.enabled("cpu_gemm", "onednn"):
        assert weights  # the frozen products went to oneDNN ...
    assert not any(w.is_mkldnn for w in weights)  # ... from the dense weights, no packed copy
    assert held_bytes(student) == weight_bytes(student)
    assert held_bytes(teacher) == weight_bytes(teacher)  # the teacher scored from its one copy


def test_keep_dense_frees_the_copies_and_forgets_a_freed_weight():
    w, other = torch.randn(64, 32), torch.randn(16, 32)
    assert gemm.pack_frozen([w, other]) == w.nbytes + other.nbytes
    assert gemm.keep_dense([w]) == w.nbytes
    assert gemm.packed_bytes() == other.nbytes  # the other weight keeps its copy
    assert gemm.pack_frozen([w]) == 0  # and w is not packed again
    assert gemm.keep_dense([w]) == 0
    x = torch.randn(9, 32)
    assert_matmul(gemm.linear(x, w), x, w.t(), what="dense")  # tolerances.py
    del w
    gc.collect()
    assert gemm._dense_only == {}  # no entry outlives its weight (ids are reused)
