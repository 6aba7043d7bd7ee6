"""Weight sync from a trainer to its sampler.

Public names: ``CheckpointEngineManager`` (``sync_weights(merge_and_sync=False)``: LoRA
weights only, or merged base+LoRA weights; copy-free when the sampler shares the trainer's
modules)."""

from twinkle.checkpoint_engine.manager import CheckpointEngineManager

__all__ = ["CheckpointEngineManager"]
