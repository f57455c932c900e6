"""A team's own model and data, brought to fedmq by import path (docs/models.md).

    fedmq agent --model "recipes.my_fleet:make_model?width=8" \
                --dataset recipes.my_fleet:load_bars ...

`make_model` is any function returning an nn.Module; its keyword arguments come from the
reference's query string. It has batch norm on purpose: fedmq sends the running statistics
with the weights (docs/models.md, "Batch norm"). `load_bars` is any function taking
`train` and `data_dir` and returning a torch Dataset of (image, label) pairs.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset


def make_model(width: int = 8, num_classes: int = 4) -> nn.Module:
    """A small conv net with batch norm for 1x16x16 images."""
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(8 * width, num_classes))


def load_bars(train: bool, data_dir: str) -> Dataset:
    """4 classes of 16x16 images: a bar at 0, 45, 90 or 135 degrees, with noise (generated;
    `data_dir` is where a real loader would read its files)."""
    gen = torch.Generator().manual_seed(0 if train else 1)
    n = 1600 if train else 400
    labels = torch.randint(0, 4, (n,), generator=gen)
    yy, xx = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")
    centre = 7.5 + 3 * (torch.rand(n, 2, generator=gen) - 0.5)
    angle = labels.float() * torch.pi / 4
    dy, dx = yy - centre[:, 0, None, None], xx - centre[:, 1, None, None]
    distance = (dx * torch.sin(angle)[:, None, None] - dy * torch.cos(angle)[:, None, None]).abs()
    along = (dx * torch.cos(angle)[:, None, None] + dy * torch.sin(angle)[:, None, None]).abs()
    images = ((distance < 1.2) & (along < 6)).float() + 0.3 * torch.randn(n, 16, 16, generator=gen)
    return TensorDataset(images.clamp(0, 1)[:, None], labels)
