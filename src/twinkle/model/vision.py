"""Vision-language models in ``TransformersModel``: where LoRA goes by default, which layers
FSDP2 shards apart, and the vision tower's run on every rank.

Under FSDP2 on more than one rank, the vision tower's blocks (Qwen's vision blocks, Gemma 3's
SigLIP layers, Gemma 4's encoder layers) are units of their own, so that no rank gathers a whole
tower at once (Qwen2.5-VL-7B's is ~675M parameters). A block gathers its weights when it runs, a
collective every rank must join, so every rank runs the tower whenever any rank does: a rank
whose rows hold no image runs it on one small dummy image whose features join the language
model's input as exactly zero (``TowerOnEveryRank``). One process runs no dummy.

Unsharded CPU training packs frozen weights for oneDNN (``twinkle.kernel.cpu_gemm.pack_frozen``);
the vision tower's and projector's plain linear layers are left dense (``plain_vision_weights``).

The frozen tower (default LoRA) saves nothing for backward: none of its weights requires a
gradient and the pixels never do, so autograd records none of its operations and its activations
are freed as each block finishes."""

import copy
import re
from collections.abc import Mapping
from typing import Any

import torch

from twinkle.model.vision_inputs import check_row_family
from twinkle.utils.errors import UserError


def sharded_layers(lm: Any) -> list[str] | None:
    """The ``_no_split_modules`` classes that FSDP2 shards one by one: all of them for a text
    model; for a model with a vision tower (``config.vision_config``), those inside its language
    model (``get_decoder()``), and the tower's blocks where it runs on every rank
    (``shards_tower``)."""
    names = getattr(lm, "_no_split_modules", None)
    if not names or getattr(lm.config, "vision_config", None) is None or not hasattr(lm, "get_decoder"):
        return names
    text = {type(m).__name__ for m in lm.get_decoder().modules()}
    layers = [n for n in names if n in text]
    return layers + tower_blocks(lm) if shards_tower(lm) else layers


# the vision tower and the projector of the families transformers ships, as module names (Gemma 4
# projects with embed_vision, and its audio tower and projector stay frozen as well)
VISION_MODULES = r"(.*\.)?(visual|vision_tower|vision_model|multi_modal_projector|embed_vision|audio_tower|embed_audio)\..*"


def plain_vision_weights(model: Any) -> list[torch.Tensor]:
    """The frozen weights of the plain ``nn.Linear`` layers in ``model``'s vision tower and
    projector (``VISION_MODULES``); a LoRA layer's base layer is not plain. A training step reads
    ``cpu_gemm``'s packed copies only in the fused LoRA nodes and the output head; these layers
    run torch's own ``F.linear`` there, so their copies would sit unread (a sampling or scoring
    pass that routes them through ``cpu_gemm`` takes the dense weight, with the same products),
    and for a tower the size of Qwen2.5-VL's (670M parameters) they would hold 2.5 GiB."""
    inside = re.compile(VISION_MODULES)
    return [
        module.weight
        for name, module in model.named_modules()
        if type(module) is torch.nn.Linear
        and not module.weight.requires_grad
        and inside.fullmatch(name)
        and not name.endswith(".base_layer")
    ]


def language_model_lora(lm: Any, config: Any) -> Any:
    """``config`` (a ``peft.LoraConfig``) for ``lm``: on a model with a vision tower,
    ``target_modules='all-linear'`` means the language model's linear layers, the vision tower
    and projector left frozen (PEFT's own ``all-linear`` takes them too). A config that sets
    ``exclude_modules`` (``[]`` for none) or names its modules is taken as it is: that is how the
    vision tower is trained as well."""
    if getattr(getattr(lm, "config", None), "vision_config", None) is None:
        return config
    if (
        getattr(config, "target_modules", None) != "all-linear"
        or getattr(config, "exclude_modules", None) is not None
    ):
        return config
    config = copy.copy(config)
    config.exclude_modules = VISION_MODULES
    return config


def check_patches(lm: Any, pixel_values: Any) -> None:
    """One line when the rows' image patches are not the size ``lm``'s vision tower cuts: rows
    encoded by another family's template (Qwen2.5-VL's 14-pixel patches on Qwen3-VL's 16-pixel
    tower, or the reverse) would otherwise fail deep inside the tower on a shape."""
    vision = getattr(lm.config, "vision_config", None)
    size = getattr(vision, "patch_size", None)
    temporal = getattr(vision, "temporal_patch_size", None)
    if not isinstance(size, int) or not isinstance(temporal, int) or pixel_values.dim() != 2:
        return
    wanted = getattr(vision, "in_channels", 3) * temporal * size * size
    if pixel_values.shape[-1] != wanted:
        raise UserError(
            f"the rows' images come in patches of {pixel_values.shape[-1]} values, but the vision tower of "
            f"{type(lm).__name__} takes {wanted} ({size}-pixel patches): the rows were encoded for another "
            "model family; encode them with this model's template (--template-cls)"
        )


def check_reads_images(lm: Any, batch: Mapping[str, Any]) -> None:
    """One line, before any forward, when the batch holds images (``pixel_values``: rows encoded
    with a vision-language template) and ``lm`` has no vision tower: a text model would fail deep
    inside on the image tokens' ids, or, where its vocabulary holds them, train on them with the
    pictures silently dropped."""
    if "pixel_values" not in batch:
        return
    if getattr(getattr(lm, "config", None), "vision_config", None) is not None:
        check_row_family(lm, batch)  # rows of a Gemma template on a Qwen model, or the reverse
        return
    counts = batch.get("image_counts")
    where = "the batch holds images"
    if torch.is_tensor(counts):
        where = f"batch row(s) {counts.nonzero()[:, 0].tolist()} hold images"
    kind = getattr(lm.config, "model_type", None) or type(lm).__name__
    raise UserError(
        f"{where} but {kind} has no vision tower; use a vision-language checkpoint "
        "(with its model_cls and template), or encode the rows without images"
    )


def _qwen_dummy(vision: Any) -> tuple[torch.Tensor, ...]:
    """One merge window: ``spatial_merge_size`` x ``spatial_merge_size`` patches, one frame."""
    merge = vision.spatial_merge_size
    width = getattr(vision, "in_channels", 3) * vision.temporal_patch_size * vision.patch_size**2
    return torch.zeros((merge * merge, width)), torch.tensor([[1, merge, merge]])


def _gemma3_dummy(vision: Any) -> tuple[torch.Tensor, ...]:
    """One image at the tower's fixed size (its position embeddings are one per patch of it)."""
    return (torch.zeros((1, 3, vision.image_size, vision.image_size)),)


def _gemma4_dummy(vision: Any) -> tuple[torch.Tensor, ...]:
    """One soft token: a ``pooling_kernel_size`` square of patches, with their (x, y) positions."""
    k = vision.pooling_kernel_size
    positions = torch.tensor([[[x, y] for y in range(k) for x in range(k)]])
    return torch.zeros((1, k * k, 3 * vision.patch_size**2)), positions


# model_type -> the smallest image its tower takes, as ``get_image_features``' arguments; the
# families whose towers FSDP2 shards block by block and run on every rank (``TowerOnEveryRank``)
DUMMY_IMAGES = {
    "qwen2_vl": _qwen_dummy,
    "qwen2_5_vl": _qwen_dummy,
    "qwen3_vl": _qwen_dummy,
    "qwen3_5": _qwen_dummy,
    "gemma3": _gemma3_dummy,
    "gemma4": _gemma4_dummy,
}


def _inner(lm: Any) -> Any:
    """The ``*Model`` under ``*ForConditionalGeneration`` (its tower and ``language_model``)."""
    return lm.model if hasattr(lm.model, "get_image_features") else lm


def _tower(lm: Any) -> Any:
    inner = _inner(lm)
    return inner.visual if hasattr(inner, "visual") else getattr(inner, "vision_tower", None)


def shards_tower(lm: Any) -> bool:
    """Whether FSDP2 shards ``lm``'s vision blocks one by one: a family whose tower can run on a
    dummy image, so that every rank runs it in every forward (``TowerOnEveryRank``)."""
    return getattr(lm.config, "model_type", None) in DUMMY_IMAGES and _tower(lm) is not None


def tower_blocks(lm: Any) -> list[str]:
    """The ``_no_split_modules`` classes (the model's and its tower's own) inside the vision tower:
    Qwen's vision blocks, Gemma 3's SigLIP layers, Gemma 4's encoder layers and patch embedder."""
    tower = _tower(lm)
    names = set(getattr(lm, "_no_split_modules", None) or []) | set(
        getattr(tower, "_no_split_modules", None) or []
    )
    return sorted(names & {type(m).__name__ for m in tower.modules()})


def dummy_image(lm: Any, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The arguments of ``get_image_features`` for the smallest image ``lm``'s tower takes, all
    zeros, in float32 as the processor gives pixels (the tower casts them)."""
    build = DUMMY_IMAGES[lm.config.model_type]
    return tuple(t.to(device) for t in build(lm.config.vision_config))


class _AddZero(torch.autograd.Function):
    """``embeds`` unchanged (a view, so the bits are the same); in backward, ``embeds``' gradient
    passes through and each of ``features`` gets a zero one, so the tower's backward runs."""

    @staticmethod
    def forward(ctx: Any, embeds: torch.Tensor, *features: torch.Tensor) -> torch.Tensor:
        ctx.shapes = [(f.shape, f.dtype, f.device) for f in features]
        return embeds.view_as(embeds)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (grad, *(torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.shapes))


def _tensors(value: Any) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class TowerOnEveryRank:
    """Under FSDP2 with the vision blocks as units of their own, every rank runs the tower
    whenever any rank does: a block gathers its weights in a collective every rank must join, and
    with LoRA on the tower each block reduces its gradients in one too.

    A pre-hook on the model (the FSDP2 root) asks the ranks, in one small all-reduce, whether any
    of them has images in this forward; a rank without them then runs the tower on
    ``dummy_image`` in a pre-hook on the language model, where a rank with images has just run
    it, so the ranks' collectives come in one order, forward and backward. The dummy's features
    join the language model's input through ``_AddZero``: the input keeps its bits (logits, loss
    and gradients are those of the rank's own rows) and the tower's weights get zero gradients,
    which add nothing to the ranks' sum. When no rank has images nobody runs the tower, so its
    weights keep no gradient, as in one process (AdamW then skips them).

    ``apply_fsdp2`` installs ``twinkle.distributed.unused_grads`` on the vision blocks as on every
    unit; it composes, as every rank calls each block as often as the others. A tower's block
    uses all its weights for any image, so it never has to fill one; it costs one all-reduce of
    a few bytes per block call with LoRA on the tower, and none with the tower frozen."""

    def __init__(self, lm: Any, group: Any = None):
        self.lm = lm
        self.group = group
        self.armed = False

    def install(self) -> None:
        self.lm.register_forward_pre_hook(self.decide, with_kwargs=True)
        _inner(self.lm).language_model.register_forward_pre_hook(self.add_dummy, with_kwargs=True)

    def decide(self, module: Any, args: tuple, kwargs: dict) -> None:
        import torch.distributed as dist

        mine = kwargs.get("pixel_values") is not None
        flag = torch.tensor([int(mine)], dtype=torch.uint8)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        self.armed = bool(flag.item()) and not mine

    def add_dummy(self, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not self.armed:
            return None
        self.armed = False
        embeds = kwargs.get("inputs_embeds")
        assert torch.is_tensor(embeds), "the language model is called with inputs_embeds"
        features = _inner(self.lm).get_image_features(*dummy_image(self.lm, embeds.device), return_dict=True)
        trained = [t for t in _tensors(features) if t.requires_grad]
        if not trained:  # a frozen tower: it ran for its weights' gathers, nothing flows back
            return None
        return args, {**kwargs, "inputs_embeds": _AddZero.apply(embeds, *trained)}


def run_tower_on_every_rank(lm: Any) -> None:
    """Install ``TowerOnEveryRank`` on a model whose vision blocks FSDP2 sharded one by one
    (``shards_tower``); every rank calls this, as it may create a gloo group over all ranks."""
    import torch.distributed as dist

    if not shards_tower(lm):
        return
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    TowerOnEveryRank(lm, group).install()
