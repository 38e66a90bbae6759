"""Pretraining: the typed config, the per-worker loop (no Ray), and the Ray Train wiring (``ray_train``)."""

from attnlab.train.config import TrainConfig, load_train_config

__all__ = ["TrainConfig", "load_train_config"]
