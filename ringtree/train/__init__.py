"""Training: the configuration, models, digits data, the trainer loop, checkpoints and traces."""

from ringtree.train.config import TrainConfig
from ringtree.train.trainer import RankResult, train

__all__ = ["RankResult", "TrainConfig", "train"]
