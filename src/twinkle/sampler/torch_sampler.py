"""``TorchSampler``: generation in plain PyTorch from the adapter being trained.

Two ways to build it:

- ``TorchSampler(model)`` with a ``TransformersModel`` (or ``MultiLoraTransformersModel``): the
  sampler runs the trainer's own modules (colocated: no copy of any weight). ``adapter_name=``
  picks the trainer's adapter; every optimizer step is visible to the next ``sample`` without a
  sync. A model in training mode is put in eval mode for sampling; its next ``forward`` puts it
  back. On a CPU the trainer's oneDNN-packed copies of its frozen weights are freed
  (``cpu_gemm.keep_dense``): decoding reads the dense weights, and the copies would hold the
  frozen model twice to speed the prefill and the training forward by a few percent.
- ``TorchSampler(model_id)``: the sampler loads its own copy of the base model. Adapters come
  from ``adapter_path=`` (a PEFT folder, loaded once per path) or from a trainer through
  ``twinkle.checkpoint_engine.CheckpointEngineManager.sync_weights``.

``engine_args``: a ``vLLMSampler`` script's engine settings (``twinkle.sampler.engine_args``
says which are honoured here and which have nothing to set).

The generation loop is ``twinkle.sampler.decode``; ``sample`` returns one ``SampleResponse``
per prompt. Within a call the prompts' common prefix is prefilled once. Between calls the
finished rows' keys and values are kept (``twinkle.sampler.turn_cache``), so a later prompt that
continues one (a multi-turn rollout's next turn) runs only its new tokens; ``reset_prefix_cache``
drops them.

Prompts may hold images on a vision-language model (the Qwen-VL families, Qwen3.5, Gemma 3 and
Gemma 4): chat rows whose messages carry ``images`` (rendered by the vision-language template, e.g.
``Qwen2_5VLTemplate``) or encoded rows with ``pixel_values`` and ``image_grid_thw`` (Gemma: no
grid); they are prefilled with their pixels and M-RoPE positions, or on Gemma with the token types
that let an image's tokens attend both ways (``twinkle.sampler.vision_prefill``), and each sequence's
``new_input_feature`` carries its prompt's images to training. Nothing of an image outlives its
call (no encoder cache; rows with images are not kept for later turns), so ``reset_mm_cache``
and ``reset_encoder_cache`` have nothing to drop."""

import contextlib
import time
from collections.abc import Generator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from twinkle.data_format.sampling import SampledSequence, SampleResponse, SamplingParams
from twinkle.kernel import cpu_gemm
from twinkle.model import TransformersModel
from twinkle.model.forward import causal_lm_of
from twinkle.model.loading import load_causal_lm, resolve_dtype
from twinkle.model.router_replay import RouterReplay, refuse_dense_folder, replay_of
from twinkle.runtime import get_runtime
from twinkle.runtime.remote import remote_class  # remote_group= hook
from twinkle.sampler import linears
from twinkle.sampler.decode import Decoder, RowOutput, drain
from twinkle.sampler.engine_args import read_engine_args
from twinkle.sampler.prompts import Prompt, new_input_feature, prompts_of
from twinkle.sampler.routes import RouteLog
from twinkle.sampler.sampler_adapters import SamplerAdapters
from twinkle.sampler.scoring import score_prompts
from twinkle.sampler.stops import Stops, eos_token_ids
from twinkle.sampler.turn_cache import TurnCache, weights_version
from twinkle.sampler.vision_prefill import check_images, image_text_class
from twinkle.template import Template, get_template
from twinkle.template.tokenizer import load_tokenizer
from twinkle.utils.errors import UserError


@remote_class  # remote_group=: built on a device group's ranks (twinkle.runtime.remote)
class TorchSampler(SamplerAdapters):
    """Batched sampling with a KV cache; see the module docstring. ``device_mesh``: the mesh the
    sampler runs on (kept for upstream's signature; each process samples its own prompts).
    ``dtype``/``model_cls``: as ``TransformersModel``'s, for a sampler that loads its own copy (a
    vision-language checkpoint that ``AutoModelForCausalLM`` cannot load, such as Qwen2.5-VL's,
    loads whole by default, as vLLM loads it)."""

    def __init__(
        self,
        model_id: Any = None,
        engine_args: Mapping[str, Any] | None = None,
        device_mesh: Any = None,
        *,
        dtype: torch.dtype | None = None,
        model_cls: Any = None,
    ):
        engine = read_engine_args(engine_args, type(self).__name__)
        self.max_model_len = engine.max_model_len
        self.image_limit = engine.image_limit  # vLLM's limit_mm_per_prompt={'image': n}
        self.return_routed_experts = engine.return_routed_experts  # twinkle.model.router_replay
        # a multi-turn rollout's next prompt continues a finished row: its positions run once
        self.turns = TurnCache() if engine.prefix_caching else None
        # vLLM's engine seed: the seeds of calls without SamplingParams.seed follow from it
        self._seeds = None if engine.seed is None else torch.Generator().manual_seed(engine.seed)
        self.runtime = get_runtime()
        self.device_mesh = device_mesh
        self.source: TransformersModel | None = None
        self.template: Template | None = None
        self.adapter_names: list[str] = []  # adapters of a sampler's own copy
        self.default_adapter: str | None = None  # what adapter_name='' runs on an own copy
        self._by_path: dict[str, str] = {}  # resolved adapter_path -> adapter name
        self.merged_keys: set[str] = set()  # linear layers of an own copy holding merged LoRA weights
        if isinstance(model_id, TransformersModel):
            if engine.dtype is not None or dtype is not None:
                raise UserError("TorchSampler(model): a sampler sharing a model runs its weights; drop dtype")
            self.source = model_id
            self.tokenizer, self.device = model_id.tokenizer, model_id.device
            if self.device.type == "cpu":  # decoding reads the dense weights: no packed copies
                weights = [m.weight for m in self.lm.modules() if isinstance(m, torch.nn.Linear)]
                cpu_gemm.keep_dense(weights)  # see twinkle.kernel.cpu_gemm
            self._hook_routers()
            return
        if model_id is not None and not isinstance(model_id, str | Path):
            raise UserError(
                f"TorchSampler({type(model_id).__name__}): pass a model id or folder, or a TransformersModel"
            )
        self.device = self.runtime.device
        if dtype is not None and engine.dtype is not None:
            raise UserError("TorchSampler: pass dtype= or engine_args['dtype'], not both")
        dtype = dtype or resolve_dtype(engine.dtype or self.runtime.defaults.dtype, self.device)
        self.model_id = None if model_id is None else str(model_id)
        if self.return_routed_experts:  # a dense folder: one line before loading
            refuse_dense_folder(self.model_id, "engine_args enable_return_routed_experts=True")
        self._own, self.tokenizer, self.model_path = load_causal_lm(
            self.model_id,
            self.device,
            dtype,
            model_cls=model_cls or self.runtime.defaults.model_cls or image_text_class(self.model_id),
        )
        self._own.eval()
        self._own.requires_grad_(False)
        self._hook_routers()
        if self.device.type == "cpu":  # the products training runs (``twinkle.sampler.linears``)
            linears.route(linears.plain_linears(self._own))
            linears.pack(self._own)

    # ----------------------------------------------------------------- set-up
    def _hook_routers(self) -> None:
        """With ``enable_return_routed_experts``, the model's routers record each forward's
        experts while it decodes (a model without routers: one line)."""
        if self.return_routed_experts:
            RouterReplay.install(self.lm, "engine_args enable_return_routed_experts=True")

    def _recording(self) -> contextlib.AbstractContextManager:
        replay = replay_of(self.lm) if self.return_routed_experts else None
        return replay.recording_all() if replay is not None else contextlib.nullcontext()

    @property
    def lm(self) -> Any:
        """The causal LM module that generates (the trainer's own when colocated)."""
        return causal_lm_of(self.source.model) if self.source is not None else self._own

    @property
    def colocated(self) -> bool:
        return self.source is not None

    def set_template(
        self, template_cls: Any = "Template", model_id: str | None = None, **kwargs: Any
    ) -> None:
        """The template prompts given as ``messages`` are rendered with (its generation prompt
        appended): a name (``twinkle.template.TEMPLATES``), a ``Template`` subclass or instance;
        ``kwargs`` reach its constructor. Its tokenizer is the model's, or ``model_id``'s."""
        if isinstance(template_cls, Template):
            if kwargs or model_id is not None:
                raise UserError("set_template got a Template instance and keywords; pass one or the other")
            self.template = template_cls
            return
        tokenizer = self.tokenizer if model_id is None else load_tokenizer(model_id)
        try:
            self.template = get_template(template_cls, tokenizer, **kwargs)
        except TypeError as exc:
            raise UserError(f"set_template({template_cls!r}): {exc}") from exc

    def reset_prefix_cache(self) -> None:
        """Drop the finished rows' keys and values kept for later turns (``TurnCache``; they are
        dropped by themselves when the weights or the adapter change)."""
        if self.turns is not None:
            self.turns.clear()

    def reset_mm_cache(self) -> None:
        """Nothing to drop: the sampler keeps no images between calls."""

    def reset_encoder_cache(self) -> None:
        """Nothing to drop: the sampler keeps no encoder outputs between calls."""

    def _template(self, adapter_name: str = "") -> Template:
        """``set_template``'s; else, colocated, the template the trainer's adapter encodes its
        rows with (``model.set_template``); else ``Template`` on the model's tokenizer."""
        if self.template is not None:
            return self.template
        if self.colocated:
            groups = self.source.optimizer_group
            group = groups.get(adapter_name) or (next(iter(groups.values())) if len(groups) == 1 else None)
            if group is not None and group.template is not None:
                return group.template
        self.template = get_template("Template", self.tokenizer)
        return self.template

    # ----------------------------------------------------------------- sampling
    @torch.no_grad()
    def sample(
        self,
        inputs: Any,
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        adapter_name: str = "",
        adapter_path: str | Path | None = None,
        *,
        use_base_model: bool = False,
    ) -> list[SampleResponse]:
        """Sample ``num_samples`` sequences for each input row: ``{'messages': [...]}`` (rendered
        by the template with its generation prompt) or ``{'input_ids': [...]}`` (the prompt's
        tokens), or a list of them. ``adapter_name``: the adapter to run ('' : the trainer's only
        adapter when colocated, else the one last synced, else none); ``adapter_path``: a PEFT
        folder to run instead; ``use_base_model=True``: no adapter at all. Returns one
        ``SampleResponse`` per row, in order."""
        return drain(
            self.sample_steps(
                inputs,
                sampling_params,
                adapter_name,
                adapter_path,
                slice_seconds=None,
                use_base_model=use_base_model,
            )
        )

    def sample_steps(
        self,
        inputs: Any,
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        adapter_name: str = "",
        adapter_path: str | Path | None = None,
        slice_seconds: float | None = 0.05,
        use_base_model: bool = False,
    ) -> Generator[None, None, list[SampleResponse]]:
        """``sample`` in slices: a generator that pauses (``yield``) once it has decoded for
        ``slice_seconds`` (None: never), outside the adapter and eval mode it runs under, so the
        caller may train or sample other adapters on the same model between slices; it returns
        ``sample``'s value. The tokens are those ``sample`` draws, however it is sliced."""
        params = self._check(_params(sampling_params))
        scoring = params.max_tokens == 0
        prompts = prompts_of(inputs, lambda: self._template(adapter_name), scoring)
        for i, prompt in enumerate(prompts):
            check_images(self.lm, i, prompt.ids, prompt.vision, self.image_limit)
        visions = [p.vision for p in prompts]
        images = any(v is not None for v in visions)
        budgets = self._budgets(prompts, params)
        stops = Stops(self.tokenizer, eos_token_ids(self.lm, self.tokenizer), params)
        generator = torch.Generator(device=self.device).manual_seed(self._seed(params))
        steps, scores = None, None
        while True:
            with (
                torch.no_grad(),
                self._adapter(adapter_name, adapter_path, use_base_model),
                self._routed(),
                self._recording(),
            ):
                if scores is None:  # the prompts' scores, under the adapter that samples
                    k = params.prompt_logprobs
                    prompt_ids = [p.ids for p in prompts]
                    scores = (
                        [None] * len(prompts) if k is None else score_prompts(self.lm, prompt_ids, k, visions)
                    )
                if scoring:
                    outputs = [[RowOutput() for _ in range(params.num_samples)] for _ in prompts]
                    break
                if steps is None:
                    pad = _pad_id(self.tokenizer)
                    replay = replay_of(self.lm) if self.return_routed_experts else None
                    routes = None if replay is None else RouteLog(replay, params.num_samples)
                    # one process's cache, of text rows (equal image tokens need not be equal images)
                    turns = self.turns if self._lockstep() is None and not images else None
                    if turns is not None:
                        turns.check_owner(
                            (adapter_name, str(adapter_path), use_base_model), weights_version(self.lm)
                        )
                    decoder = Decoder(self.lm, params, stops, pad, generator, self._lockstep(), routes, turns)
                    steps = decoder.steps([p.ids for p in prompts], budgets, visions if images else None)
                end = None if slice_seconds is None else time.perf_counter() + slice_seconds
                try:
                    next(steps)  # at least one step a slice
                    while end is None or time.perf_counter() < end:
                        next(steps)
                except StopIteration as done:
                    outputs = done.value
                    break
            yield
        return [
            SampleResponse(
                sequences=[self._sequence(prompt, out, stops) for out in outs],
                prompt_token_ids=list(prompt.ids),
                prompt_logprobs=None if score is None else score[0],
                topk_prompt_logprobs=None if score is None else score[1],
            )
            for prompt, outs, score in zip(prompts, outputs, scores, strict=True)
        ]

    def _check(self, params: SamplingParams) -> SamplingParams:
        if params.repetition_penalty != 1:
            raise UserError(
                f"TorchSampler: not supported yet: SamplingParams(repetition_penalty={params.repetition_penalty}); "
                "leave it at 1 (vLLMSampler on a GPU applies it)"
            )
        if params.prompt_logprobs is not None and self._lockstep() is not None:
            raise UserError(
                "TorchSampler: not supported yet: prompt_logprobs with a sampler sharing an FSDP-sharded "
                "model; score with a sampler of its own (TorchSampler(model_id))"
            )
        return params

    def _seed(self, params: SamplingParams) -> int:
        """The call's seed: ``params.seed``; else drawn from the engine seed, else from torch's
        global generator."""
        if params.seed is not None:
            return params.seed
        return (
            int(torch.randint(0, 2**62, (), generator=self._seeds))
            if self._seeds
            else int(torch.empty((), dtype=torch.int64).random_())
        )

    def _sequence(self, prompt: Prompt, out: Any, stops: Stops) -> SampledSequence:
        decoded = stops.text(out.tokens, out.by_string)
        row = new_input_feature(prompt, out.tokens, decoded)
        if out.routed_experts is not None:  # upstream's row carries them as lists
            row["routed_experts"] = out.routed_experts.tolist()
        return SampledSequence(
            tokens=out.tokens,
            logprobs=out.logprobs,
            decoded=decoded,
            stop_reason=out.stop_reason,
            new_input_feature=row,
            routed_experts=out.routed_experts,
        )

    def _budgets(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[int]:
        """The most tokens each prompt's sequences may have: ``max_tokens``, and no more than
        the model's maximum positions (or ``engine_args['max_model_len']``) leave after the
        prompt."""
        config = self.lm.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config  # a VL model's
        limits = [getattr(text, "max_position_embeddings", None), self.max_model_len]
        limit = min((x for x in limits if x is not None), default=None)
        what = (
            "max_model_len is"
            if limit is not None and limit == self.max_model_len
            else "the model takes at most"
        )
        budgets = []
        for i, prompt in enumerate(prompts):
            if limit is not None and len(prompt.ids) + (params.max_tokens != 0) > limit:
                raise UserError(
                    f"input row {i} has {len(prompt.ids)} prompt tokens, but {what} {limit} "
                    "positions; shorten the prompt"
                )
            room = None if limit is None else limit - len(prompt.ids)
            if params.max_tokens is None and room is None:
                raise UserError("the model has no maximum positions; set SamplingParams(max_tokens=...)")
            budgets.append(min(x for x in (params.max_tokens, room) if x is not None))
        return budgets

    def _routed(self) -> contextlib.AbstractContextManager:
        """A shared trainer's plain linear layers (its head) run training's CPU products while
        sampling; a sampler's own copy was routed when loaded."""
        if self.colocated and self.device.type == "cpu" and not self.runtime.is_distributed:
            return linears.routed(self.lm)
        return contextlib.nullcontext()

    def _lockstep(self) -> Any:
        """Under FSDP a sampler sharing the sharded model must run the same forwards on every
        rank (``twinkle.sampler.decode``): the ranks agree each step whether any still works."""
        if not (self.colocated and self.runtime.is_distributed):
            return None
        from twinkle.distributed.collectives import all_reduce_sum

        return lambda mine: all_reduce_sum([float(mine)])[0] > 0


def _params(value: Any) -> SamplingParams:
    if value is None:
        return SamplingParams()
    if isinstance(value, SamplingParams):
        return value
    if isinstance(value, Mapping):
        return SamplingParams.from_dict(value)
    raise UserError(f"sampling_params= got {type(value).__name__}; pass a SamplingParams or a dict")


def _pad_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return pad if pad is not None else 0
