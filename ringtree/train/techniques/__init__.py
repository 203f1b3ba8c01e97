"""The single-device playbook: activation checkpointing, mixed precision, distillation, loaders."""

from ringtree.train.techniques.activation_checkpointing import (
    default_segments,
    enable_checkpointing,
    run_blocks,
)
from ringtree.train.techniques.amp import AMP_MODES, MixedPrecision
from ringtree.train.techniques.distill import distillation_loss, load_teacher
from ringtree.train.techniques.loaders import PrefetchLoader, ShardedStream

__all__ = [
    "AMP_MODES",
    "MixedPrecision",
    "PrefetchLoader",
    "ShardedStream",
    "default_segments",
    "distillation_loss",
    "enable_checkpointing",
    "load_teacher",
    "run_blocks",
]
