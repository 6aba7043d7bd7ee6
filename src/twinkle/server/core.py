"""``ModelCore``: the server's model, one ``MultiLoraTransformersModel`` holding every tenant's
adapter, and each Tinker operation on it as one whole call that takes plain inputs (names,
token arrays, dicts, paths) and returns plain outputs (numpy arrays, dicts, floats).

It lives where the model lives: in the server's process (``--mode local``), or on every rank of
the device group ``model`` (``--mode ray``, built with ``remote_group='model'``;
``twinkle.runtime.remote``), where the driver's call runs on each rank and returns rank 0's value.
Nothing is read from it after a call, so both ways behave the same. Its method names stay clear of
those ``twinkle.runtime.remote`` reduces on its own (``forward``, ``forward_only``,
``forward_backward``): a pass over datums is ``run_datums``.

Tinker datums become twinkle batches in ``twinkle.server.datums``. The losses are
``twinkle.server.losses.TinkerLoss``. The optimizer step applies Tinker's gradient: that of the
summed loss of every ``run_datums`` since the last step (no division by a token count).
``loss_fn_config={"twinkle_reduction": "token_mean"}`` (what ``twinkle_client`` sends) asks
for the local API's instead: the mean over the window's counted tokens (weight or advantage
not 0).

On a group of N ranks (FSDP2) each rank runs its contiguous share of the datums
(``DeviceMesh.get_slice``); the per-datum outputs are gathered back in order on every rank, and
the step's gradient is the one a single process computes (``optim_step``)."""

import copy
import math
from collections.abc import Generator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from twinkle.model import MultiLoraTransformersModel
from twinkle.runtime.remote import remote_class  # remote_group= hook
from twinkle.server.datums import datum_batch, lora_config
from twinkle.server.losses import TinkerLoss
from twinkle.server.sampler_calls import Images, prompt_row, run_sampler, sampling_params, sequences_of
from twinkle.server.scoring import Scoring, score_rows, topk
from twinkle.server.wire import Datum
from twinkle.utils.errors import UserError
from twinkle.utils.modules import set_training

REDUCTION_KEY = "twinkle_reduction"  # a loss_fn_config key of this server's own
REDUCTIONS = ("sum", "token_mean")


def gather_in_order(mine: Any) -> list[Any]:
    """Every rank's ``mine``, in rank order (``[mine]`` in one process)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return parts


@remote_class  # remote_group=: built on a device group's ranks (twinkle.runtime.remote)
class ModelCore:
    """The shared model and the per-adapter operations (adapter names are the run ids)."""

    def __init__(self, model_id: str | None, max_loras: int, max_r: int):
        from twinkle.server.images import model_cls_of

        self.model = MultiLoraTransformersModel(
            model_id, max_loras=max_loras, max_r=max_r, model_cls=model_cls_of(model_id)
        )
        if getattr(self.model, "router_aux", None) is not None:
            # the aux's weight is fixed at each backward, and a window's reduction (sum or mean)
            # is known only at its optim_step, after every backward has run
            raise UserError(
                f"{model_id}: its config asks for the router's auxiliary loss (output_router_logits=True), "
                "which the service cannot weigh: a window's losses are summed or averaged only at optim_step; "
                "set output_router_logits to false in the checkpoint's config.json"
            )
        self.vocab = int(self.model.model.get_input_embeddings().weight.shape[0])
        pad = self.model.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else 0)
        self.optim_params: dict[str, dict[str, float]] = {}
        self.window_reduction: dict[str, str] = {}  # adapter -> its open window's reduction
        self.sampler: Any = None  # a TorchSampler on this model, made at the first lone sample
        self.batch: Any = None  # the shared decoding batch (``decode_batch``), made at the first sample
        # adapter -> its state before its last optim_step (``_snapshot``), for ``_diverged``
        self.good: dict[str, tuple] = {}
        self.context = getattr(self.model.model.config, "max_position_embeddings", None)

    # ---------------------------------------------------------------- adapters
    def add(self, name: str, rank: int) -> None:
        from twinkle.model.forward import causal_lm_of

        self.model.add_adapter_to_model(name, lora_config(rank, causal_lm_of(self.model.model)))

    def remove(self, name: str) -> None:
        """Free the adapter's slot (its last AdamW settings are kept for a reload)."""
        self.good.pop(name, None)
        if name in self.model.optimizer_group:
            self.model.remove_adapter(name)

    def free_slots(self) -> int:
        return len(self.model.slots.free())

    # ---------------------------------------------------------------- training
    def run_datums(
        self, name: str, data: list[Datum], loss_fn: str, config: dict[str, Any], forward_only: bool
    ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """One pass (with backward unless ``forward_only``) over this rank's share of ``data``;
        per datum (all of them, in order) its targets' ``logprobs`` and ``elementwise_loss``, and
        the ``loss:sum`` metric. The request was checked already (``routes.training.check_datums``)."""
        if not forward_only:
            self._open_window(name, config)
        mesh = self.model.runtime.mesh
        mine = data[mesh.get_slice(len(data))] if self.model.runtime.is_distributed else data
        loss = TinkerLoss(loss_fn, config)
        self.model.set_loss(loss, adapter_name=name)
        batch, extras = datum_batch(mine, loss_fn, self.pad_id)
        if forward_only:
            # loss_fn_config disable_lora: the base model's log-probs (a reference pass)
            off = bool(config.get("disable_lora"))
            self.model.forward_only(batch, adapter_name=name, disable_lora=off, **extras)
        else:
            self.model.forward_backward(batch, adapter_name=name, **extras)
        sizes = [d.tokens.size for d in mine]
        logps = torch.split(loss.last_logps, sizes)
        per_token = torch.split(loss.last_per_token, sizes)
        outputs = [
            {"logprobs": lp.numpy(), "elementwise_loss": pt.numpy()}
            for lp, pt in zip(logps, per_token, strict=True)
        ]
        parts = gather_in_order((outputs, float(loss.last_per_token.sum())))
        total = sum(s for _, s in parts)
        if not math.isfinite(total):
            self._diverged(name, f"the loss is {total}")
        return [o for part, _ in parts for o in part], {"loss:sum": total}

    def run_teacher(
        self, name: str, data: list[Datum], loss: Any, forward_only: bool
    ) -> tuple[list[dict[str, np.ndarray]], float, int]:
        """``GKDLoss`` on the datums and the teacher's top-k they carry
        (``twinkle.server.model_steps``): the model's own step over this rank's share. Per datum
        (all of them, in order) its targets' ``logprobs`` under the student; the summed loss and
        its token count over the ranks."""
        from twinkle.server.model_steps import teacher_batch

        if not forward_only:
            self._open_window(name, {REDUCTION_KEY: "token_mean"})
        mine = self._share(data)
        self.model.set_loss(loss, adapter_name=name)
        batch, teacher = teacher_batch(mine, self.pad_id)
        call = self.model.forward_only if forward_only else self.model.forward_backward
        out = call(batch, adapter_name=name, **teacher)
        logps = out.get("logps") if mine else None
        outputs = [
            {"logprobs": logps[b, 1 : 1 + d.tokens.size].float().cpu().numpy()} for b, d in enumerate(mine)
        ]
        count = int(out.get("num_tokens"))
        return self._joined(name, outputs, float(out) * count if count else 0.0, count)

    def run_embedding(
        self, name: str, data: list[Datum], loss: Any, forward_only: bool
    ) -> tuple[list[dict[str, np.ndarray]], float, int]:
        """``task='embedding'`` on the datums' rows (``twinkle.server.model_steps``), the loss
        ``loss`` (None: embeddings only). Every rank runs every row: the in-batch negatives are
        the request's rows, and the model's count summed over the ranks divides the gradients
        FSDP2 averaged, so the step is one process's. Per datum its ``embeddings``; the summed
        loss and its group count (0 without a loss)."""
        from twinkle.server.model_steps import embedding_rows

        rows = embedding_rows(data)
        if loss is None:  # the last request's loss must not be read as this pass's
            loss = TinkerLoss("cross_entropy", {})
        self.model.set_loss(loss, adapter_name=name)
        if forward_only:
            out = self.model.forward_only(rows, task="embedding", adapter_name=name)
            embeddings, count = out["embeddings"], int(out["num_tokens"])
            total = float(out["loss"]) * count if count else 0.0
        else:
            self._open_window(name, {REDUCTION_KEY: "token_mean"})
            step = self.model.forward(rows, task="embedding", adapter_name=name)
            # the rows' pooled embeddings, which this forward's loss saw (detached)
            embeddings = self.model._pending_backward[1].embeddings
            count = int(step["num_tokens"])
            total = self.model.backward() * count
        if not math.isfinite(total):
            self._diverged(name, f"the loss is {total}")
        outputs = [{"embeddings": e.float().cpu().numpy()} for e in embeddings]
        return outputs, total, count

    def _share(self, data: list[Datum]) -> list[Datum]:
        """This rank's contiguous share of the datums (all of them in one process)."""
        mesh = self.model.runtime.mesh
        return data[mesh.get_slice(len(data))] if self.model.runtime.is_distributed else data

    def _joined(
        self, name: str, outputs: list[dict[str, np.ndarray]], total: float, count: int
    ) -> tuple[list[dict[str, np.ndarray]], float, int]:
        """Every rank's per-datum outputs in order, the summed loss and count over the ranks; a
        loss that is not finite rolls the adapter back (``_diverged``)."""
        parts = gather_in_order((outputs, total, count))
        total, count = sum(p[1] for p in parts), sum(p[2] for p in parts)
        if not math.isfinite(total):
            self._diverged(name, f"the loss is {total}")
        return [o for part in parts for o in part[0]], total, count

    def _diverged(self, name: str, what: str) -> None:
        """A non-finite loss: the window's gradients are dropped and the adapter (weights and AdamW
        state) goes back to where it was before its last ``optim_step``, the last weights whose
        loss was finite; ``UserError`` says so."""
        self.model.zero_grad(adapter_name=name)
        self.window_reduction.pop(name, None)
        good = self.good.pop(name, None)
        if good is None:
            raise UserError(f"{what} under this run's weights; nothing was changed (check the datums)")
        self._restore(name, good)
        raise UserError(
            f"{what} after the last optim_step (learning_rate {good[2]:g}): the adapter and its AdamW state "
            "were rolled back to before that step; lower the learning rate"
        )

    def _snapshot(self, name: str, lr: float) -> tuple:
        """(adapter weights, AdamW state, learning rate of the coming step): copies."""
        group = self.model.optimizer_group[name]
        state = None
        if group.optimizer is not None:  # tensors cloned directly: deepcopy's walk took several times as long
            live = group.optimizer.state_dict()
            state = {
                "state": {
                    i: {k: v.clone() if torch.is_tensor(v) else copy.deepcopy(v) for k, v in st.items()}
                    for i, st in live["state"].items()
                },
                "param_groups": copy.deepcopy(live["param_groups"]),
            }
        weights = {k: v.clone() for k, v in self.model.slots.export(name).items()}  # export may give views
        return weights, state, lr

    def _restore(self, name: str, snapshot: tuple) -> None:
        weights, state, _ = snapshot
        problems = self.model.slots.load(name, weights)
        assert not problems, problems  # the adapter's own export, written back
        group = self.model.optimizer_group[name]
        if group.optimizer is not None:
            if state is not None:
                group.optimizer.load_state_dict(state)
            group.optimizer.sync_copies()

    def _open_window(self, name: str, config: dict[str, Any]) -> None:
        """Record the reduction the adapter's open window is accumulated with (one per window)."""
        reduction = config.get(REDUCTION_KEY, "sum")
        if reduction not in REDUCTIONS:
            raise UserError(
                f"loss_fn_config[{REDUCTION_KEY!r}] must be one of {', '.join(REDUCTIONS)}, got {reduction!r}"
            )
        open_ = self.window_reduction.get(name)
        if open_ is not None and open_ != reduction and self.model.optimizer_group[name].window_batches:
            raise UserError(
                f"this run's gradients since the last optim_step were accumulated with {REDUCTION_KEY}="
                f"{open_!r}, not {reduction!r}; call optim_step first or send the same reduction"
            )
        self.window_reduction[name] = reduction

    def optim_step(self, name: str, params: dict[str, Any], clip: float) -> dict[str, float]:
        """AdamW (``params``: its ``lr``, ``betas``, ``eps``, ``weight_decay``) on the window's
        gradients, their norm clipped to ``clip`` (0: not clipped): their sum (Tinker's), or
        their mean over the counted tokens when the window asked for ``token_mean``. A window of
        only zero weights still steps (a zero gradient; Adam's moments move the weights as on
        Tinker).

        The model divides the gradients by the window's token count summed over the ranks (and
        multiplies them by the number of ranks, as FSDP2 averaged them): for the sum, the count
        is 1 on rank 0 and 0 elsewhere."""
        group = self.model.optimizer_group[name]
        self.optim_params[name] = params
        if group.optimizer is None:
            self.model.set_optimizer("AdamW", adapter_name=name, **params)
        else:
            for g in group.optimizer.param_groups:
                g.update(params)
        if self.window_reduction.pop(name, "sum") == "sum" and group.window_batches:
            group.window_tokens = int(self.model.runtime.rank == 0)
        before = self._snapshot(name, params["lr"])
        norm = self.model.clip_grad_norm(clip, adapter_name=name)
        if not math.isfinite(norm):
            self.model.zero_grad(adapter_name=name)
            raise UserError(
                f"the gradient's norm is {norm}: the step was not taken and the gradients since the "
                "last optim_step were dropped"
            )
        stepped = self.model.step(adapter_name=name)
        self.model.zero_grad(adapter_name=name)
        if not all(bool(torch.isfinite(c).all()) for c in group.optimizer.copies):
            self._restore(name, before)
            raise UserError(
                f"optim_step at learning_rate {params['lr']:g} made the adapter's weights non-finite: "
                "the step was undone; lower the learning rate"
            )
        self.good[name] = before
        return {"grad_norm": float(norm), "stepped": float(stepped)}

    # ---------------------------------------------------------------- checkpoints
    def save(self, name: str, folder: Path, optimizer: bool) -> None:
        self.model.save(
            folder.name, output_dir=str(folder.parent), adapter_name=name, save_optimizer=optimizer
        )

    def load(self, name: str, folder: Path, optimizer: bool) -> None:
        """The adapter's weights from ``folder``; with ``optimizer``, its AdamW state too (an
        optimizer is made first when the adapter has none; the next ``optim_step`` sets its
        hyperparameters)."""
        self.good.pop(name, None)  # the loaded state is where a rollback stops
        if optimizer and self.model.optimizer_group[name].optimizer is None:
            self.model.set_optimizer("AdamW", adapter_name=name, **self.optim_params.get(name, {"lr": 1e-4}))
        self.model.resume_from_checkpoint(str(folder), resume_only_model=not optimizer, adapter_name=name)

    def load_for_sampling(self, name: str, folder: Path) -> None:
        """Only the adapter's weights from ``folder``, into a slot lent for one sample request (its
        counters, optimizer and RNG are of no use there, so nothing else is read or logged)."""
        self.model.load(str(folder), adapter_name=name)

    def adapter_state(self, name: str) -> dict[str, torch.Tensor]:
        return self.model.slots.export(name)

    # ---------------------------------------------------------------- sampling on this model
    @torch.no_grad()
    def next_token_logps(self, name: str, ids: list[int], vision: Images = None) -> torch.Tensor:
        """Row ``i``: log p(next token | ids[:i + 1]) over the vocabulary under adapter ``name``
        (fp32, temperature 1). ``vision``: the prompt's placed images (``twinkle.server.images``),
        given to the model with which tokens are an image's, so it works out the M-RoPE positions
        its processor's rows get. Under FSDP2 every rank runs the same forward."""
        from twinkle.model.forward import causal_lm_of
        from twinkle.model.vision_positions import token_type_inputs
        from twinkle.sampler.gemma_images import image_token_types, is_gemma

        m = self.model
        m.adapters.activate(name)
        set_training(m.model, False)
        m._in_train_mode = False
        tokens = torch.tensor([ids], device=m.device)
        images: dict[str, torch.Tensor] = {}
        if vision is not None:
            images = {k: torch.from_numpy(v).to(m.device) for k, v in vision.items()}
            lm = causal_lm_of(m.model)  # Gemma's token types go by the family's own name
            images.update(image_token_types(lm, tokens) if is_gemma(lm) else token_type_inputs(lm, tokens))
        out = m.model(input_ids=tokens, **images)
        return torch.log_softmax(out.logits[0].float().cpu(), dim=-1)

    def score_prompt(
        self, name: str, prompt: list[int], want: Scoring, vision: Images = None
    ) -> dict[str, Any]:
        """What ``want`` asks of the prompt (with its images) under adapter ``name``, from one
        forward pass (``twinkle.server.scoring.score_rows``): numpy arrays only."""
        return score_rows(self.next_token_logps(name, prompt, vision)[:-1], prompt, want)

    def topk_of_completions(
        self, name: str, prompt: list[int], completions: list[list[int]], k: int, vision: Images = None
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per completion, the ``k`` most likely tokens (ids, log-probs) at each of its positions,
        from a forward pass over prompt + completion (with the prompt's images)."""
        return [
            topk(self.next_token_logps(name, prompt + tokens, vision)[len(prompt) - 1 : -1], k)
            for tokens in completions
        ]

    def sample(
        self, name: str, prompt: list[int], params: dict[str, Any], n: int, seed: int, vision: Images = None
    ) -> list[tuple]:
        """``n`` completions under adapter ``name`` by ``twinkle.sampler.TorchSampler``, sharing
        this model's modules: (tokens, their log-probs at temperature 1, "stop"|"length")."""
        return run_sampler(self._sampler(), name, prompt, params, n, seed, vision)

    def sample_steps(
        self,
        name: str,
        prompt: list[int],
        params: dict[str, Any],
        n: int,
        seed: int,
        slice_seconds: float | None,
        vision: Images = None,
    ) -> Generator[float | None, None, list[tuple]]:
        """``sample`` in slices of about ``slice_seconds`` (None: one slice): a generator that
        pauses between slices and returns ``sample``'s value, the same tokens.

        In one process a text prompt joins the model's shared decoding batch (``decode_batch``):
        each slice admits the requests waiting and decodes a chunk of every request in the batch,
        whichever request's slice it is, and each pause yields the seconds of decoding this
        request took part in since the last one (what the queue charges against its ceiling). A
        generator closed early (cancelled, or stopped at the ceiling) takes its rows out of the
        batch. Elsewhere (FSDP ranks), and for a prompt with images (``vision``), it runs
        ``TorchSampler.sample_steps`` on its own: the shared batch prefills text with plain
        positions, while an image prompt needs the vision tower in its prefill and M-RoPE
        positions that go on from its largest one (``twinkle.sampler.vision_prefill``)."""
        batch = self.decode_batch()
        if batch is None or vision is not None:
            (response,) = yield from self._sampler().sample_steps(
                prompt_row(prompt, vision),
                sampling_params(params, n, seed),
                adapter_name=name,
                slice_seconds=slice_seconds,
            )
            return sequences_of(response)
        stream = batch.add(name, list(prompt), sampling_params(params, n, seed), seed)
        reported = 0.0
        try:
            while not stream.done:
                batch.run(slice_seconds, until=stream)
                if stream.done:
                    break
                yield stream.ran - reported
                reported = stream.ran
        finally:
            batch.drop(stream)
        return [
            (row.tokens, [entry[0][1] for entry in row.logprobs], row.stop_reason) for row in stream.result()
        ]

    def decode_batch(self) -> Any:
        """The decoding batch every sample on this model joins (``twinkle.sampler.batch``), made
        at the first sample; None where it does not apply: a model sharded over ranks (whose
        ranks must run the same forwards) or one with sliding-window attention (whose cache the
        batch does not lay out), or with linear-attention layers (a recurrent state, not a list of
        positions): every cache layer must be a plain one, as the model's own config lays them
        out (a vision-language config names its text layers' kinds in its text config)."""
        if self.batch is None and not self.model.runtime.is_distributed:
            from twinkle.model.forward import causal_lm_of
            from twinkle.sampler.batch import DecodeBatch
            from twinkle.sampler.decode import plain_cache_layers
            from twinkle.sampler.row_adapters import SlotRowAdapters

            lm = causal_lm_of(self.model.model)
            if plain_cache_layers(lm.config):
                self.batch = DecodeBatch(lm, self.model.tokenizer, SlotRowAdapters(self.model))
        return self.batch

    def _sampler(self) -> Any:
        from twinkle.sampler import TorchSampler

        if self.sampler is None:
            self.sampler = TorchSampler(self.model)
        return self.sampler
