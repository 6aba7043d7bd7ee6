"""GKD through the model's step: the teacher's tensors in upstream's layout reach the right
tokens (the loss equals the divergence computed from plain HF logits), the in-process teacher,
the sampler as teacher and the teacher cache agree, and a teacher distilled into a copy of
itself gives a divergence of ~0 and leaves the logits where they were.

Tolerances: the model runs fp32 (packed rows, the head on the supervised rows) while the
reference runs the padded batch through HF in fp32 and the divergence in float64; the logits of
the two paths differ by fp32 rounding of a 2-layer model (about 1e-6 relative), so losses of
size ~1 agree within 1e-4 and a self-distillation loss is below 1e-6."""

import pytest
import torch

from twinkle.data_format import SamplingParams
from twinkle.loss import GKDLoss
from twinkle.loss.gkd import topk_prompt_inputs
from twinkle.model.teacher import TeacherCache, check_same_vocabulary, padded, teacher_topk
from twinkle.sampler import TorchSampler
from twinkle.utils.errors import UserError

PROMPTS = [
    {"messages": [{"role": "user", "content": "Who are you?"}]},
    {"messages": [{"role": "user", "content": "twinkle Paris"}]},
]


@pytest.fixture(scope="module")
def other_teacher_dir(tmp_path_factory):
    """Another tiny model, its final norm scaled so its distributions are sharp (a random tiny
    model's are near uniform, where a misaligned teacher would go unnoticed)."""
    from tiny import build_tiny_model
    from transformers import AutoModelForCausalLM

    out = build_tiny_model(tmp_path_factory.mktemp("tiny-teacher"), seed=1)
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        model.model.norm.weight.mul_(20.0)
    model.save_pretrained(out)
    return out


def rows_of(model, n=5, seed=3):
    sampler = TorchSampler(model)
    responses = sampler.sample(PROMPTS, SamplingParams(max_tokens=n, num_samples=2, seed=seed))
    return [s.new_input_feature for r in responses for s in r.sequences]


def reference_loss(student_lm, teacher_lm, rows, beta, k):
    """The mean divergence over the completion tokens from the padded HF logits, in float64."""
    ids, mask, targets = padded(rows, 0)
    with torch.no_grad():
        s = student_lm(input_ids=ids, attention_mask=mask).logits.double()
        t = teacher_lm(input_ids=ids, attention_mask=mask).logits.double()
    where = targets != -100
    s, t = s[where], t[where]
    t_top, keep = torch.log_softmax(t, -1).topk(k, dim=-1)
    ps, pt = torch.log_softmax(s.gather(-1, keep), -1), torch.log_softmax(t_top, -1)
    if beta == 0:
        return float((pt.exp() * (pt - ps)).sum(-1).mean())
    m = torch.log(beta * pt.exp() + (1 - beta) * ps.exp())
    kl = lambda p, q: (p.exp() * (p - q)).sum(-1)  # noqa: E731
    return float((beta * kl(pt, m) + (1 - beta) * kl(ps, m)).mean())


def test_the_step_equals_the_divergence_of_plain_logits(make_model, other_teacher_dir):
    from transformers import AutoModelForCausalLM

    model = make_model()
    teacher = AutoModelForCausalLM.from_pretrained(other_teacher_dir)
    rows = rows_of(model)
    for beta in (0.0, 0.5):
        model.set_loss(GKDLoss(beta=beta))
        got = model.forward_backward(inputs=rows, **teacher_topk(teacher, rows, 16))
        want = reference_loss(model.model, teacher, rows, beta, 16)
        assert got == pytest.approx(want, abs=1e-4 * (1 + want))
        assert want > 0.2  # a sharp teacher of other weights: a real divergence
        shifted = {k: v.roll(1, dims=1) for k, v in teacher_topk(teacher, rows, 16).items()}
        misaligned = model.forward_backward(inputs=rows, **shifted)
        assert misaligned != pytest.approx(want, abs=10 * 1e-4 * (1 + want))  # off by one: caught
    model.clip_grad_and_step()


def test_full_teacher_logits_and_the_sampler_as_teacher_agree(make_model, other_teacher_dir):
    from transformers import AutoModelForCausalLM

    model = make_model()
    teacher = AutoModelForCausalLM.from_pretrained(other_teacher_dir)
    rows = rows_of(model)
    vocab = teacher.config.vocab_size
    model.set_loss(GKDLoss(beta=0.5))
    ids, mask, _ = padded(rows, 0)
    with torch.no_grad():
        logits = teacher(input_ids=ids, attention_mask=mask).logits
    full = model.forward_backward(inputs=rows, teacher_logits=logits)
    in_process = model.forward_backward(inputs=rows, **teacher_topk(teacher, rows, vocab))
    scored = TorchSampler(str(other_teacher_dir)).sample(
        rows, SamplingParams(max_tokens=0, prompt_logprobs=vocab)
    )
    by_sampler = model.forward_backward(inputs=rows, **topk_prompt_inputs(scored, vocab))
    assert in_process == pytest.approx(full, abs=1e-5)
    assert by_sampler == pytest.approx(full, abs=1e-5)
    model.zero_grad()


def test_the_cache_scores_each_row_once(other_teacher_dir, make_model):
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(other_teacher_dir)
    rows = rows_of(make_model())
    cache = TeacherCache(teacher, 8)
    first = cache.inputs(rows[:3])
    again = cache.inputs(rows[1:3] + rows[:1])
    assert cache.scored == 3
    direct = teacher_topk(teacher, rows[:3], 8)
    for key in first:
        torch.testing.assert_close(first[key], direct[key][:, : first[key].shape[1]])
        torch.testing.assert_close(again[key][2], first[key][0][: again[key].shape[1]])


def test_a_teacher_distilled_into_its_own_copy(make_model, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = make_model()  # LoRA B = 0: the student starts as the base model
    model.set_optimizer("SGD", lr=0.5)
    teacher = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    rows = rows_of(model)
    model.set_loss(GKDLoss(beta=0.5, topk=32))
    ids, mask, _ = padded(rows, 0)
    with torch.no_grad():
        before = model.model(input_ids=ids, attention_mask=mask).logits
    for _ in range(3):
        loss = model.forward_backward(inputs=rows, **teacher_topk(teacher, rows, 32))
        assert abs(loss) < 1e-6
        model.clip_grad_and_step()
    with torch.no_grad():
        after = model.model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(after, before, rtol=0, atol=1e-4)


def test_teacher_bad_input(tiny_model_dir, other_teacher_dir, make_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    check_same_vocabulary(tok, AutoTokenizer.from_pretrained(other_teacher_dir))  # same tokenizer
    other = AutoTokenizer.from_pretrained(tiny_model_dir)
    other.add_tokens(["<extra_teacher_token>"])
    with pytest.raises(UserError, match="not the student's"):
        check_same_vocabulary(tok, other)
    teacher = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = make_model()
    rows = rows_of(model)
    with pytest.raises(UserError, match="top-k must be a whole number"):
        teacher_topk(teacher, rows, teacher.config.vocab_size + 1)
    model.set_loss(GKDLoss())
    with pytest.raises(UserError, match="rows"):
        model.forward_backward(inputs=rows, **teacher_topk(teacher, rows[:2], 4))
