"""The model `auto` (or a zoo model) means on a dataset known only by its files.

A folder dataset (`folder:NAME`) or a factory has no default model until its images are read.
Every role that loads the dataset anyway (the aggregator, an agent, `fedmq start-model`, the
simulator) reads them here first and sets `cfg.model` to what `auto` picks for their shape and
class count, or the model named built for them, so all of them build the same network and a
user's own folder needs no `--model`.
"""

from __future__ import annotations

from fedmq.config import Config
from fedmq.data import load_dataset
from fedmq.models import has_default_model, model_for_images


def fit_model(cfg: Config) -> str:
    """Set cfg.model for the images of cfg.data.dataset where the dataset has no default model of
    its own; what a plan says of the choice ("" where nothing was chosen)."""
    d = cfg.data
    if has_default_model(d.dataset):
        return ""
    train = load_dataset(d.dataset, data_dir=d.data_dir, train=True, download=d.download)
    asked = cfg.model
    cfg.model = model_for_images(asked, d.dataset, train.image_shape, train.num_classes)
    images = f"{'x'.join(map(str, train.image_shape))} images in {train.num_classes} classes"
    if asked == "auto":
        return f"the default for {images}; --set model=NAME for another"
    return f"{asked} built for {images}" if cfg.model != asked else ""
