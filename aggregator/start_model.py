"""Train a start model on public data: where a real fleet starts.

    fedmq start-model --dataset folder:cifar10 --data-dir DIR --out start.pt
    fedmq aggregator --dataset folder:cifar10 --data-dir DIR --init start.pt ...

A fleet in the field does not start from a random init: its server holds a model trained on
data it may use (a public dataset, a team's own), and the fleet personalizes it. This command
trains such a model on `data.public_images` train images, unrotated and disjoint from the
server's cluster sets and every agent's pool (the same images for every seed and K), and
writes it for `--init`. The simulator's real-size scenarios set `data.public_images` and start
from it themselves: every method of a comparison, the frozen control and Local included,
specializes from the same model.

Training is SGD with momentum 0.9, weight decay 5e-4, batch 64 and a cosine rate from
`aggregator.pretrain_lr` over `aggregator.start_epochs`, with the augmentation
`aggregator.start_augment` drawn afresh each epoch; it stops at `aggregator.start_max_seconds`.
The result is kept in the disk cache by data, model and settings, so the second run of a
comparison, and every seed, reads it in a second. Progress lines carry an estimate of the end.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from aggregator.bootstrap import cached_vectors, warn_if_stuck
from fedmq import disk_cache
from fedmq.atomic_file import atomic_write
from fedmq.config import Config, add_config_arguments, config_from_args
from fedmq.data import RotatedClusters, clusters_from_settings
from fedmq.data.clusters import AUTO_PUBLIC
from fedmq.errors import UsageError
from fedmq.logs import PROGRESS, event, get_logger, setup_logging
from fedmq.model_for_data import fit_model
from fedmq.models import (
    INIT_VECTOR_SUFFIX,
    build_model,
    load_vector,
    model_spec,
    resolve_model_name,
    to_vector,
)
from fedmq.training import evaluate, fit

log = get_logger("aggregator.start")

BATCH = 64
WEIGHT_DECAY = 5e-4
TEST_IMAGES = 2000
"""Unrotated test images the start model is scored on (a fixed draw of the test split)."""
PROGRESS_EVERY_S = 10.0


@dataclass(frozen=True)
class StartModel:
    vector: torch.Tensor
    accuracy: float
    """On TEST_IMAGES unrotated test images."""
    seconds: float
    cached: bool


def augmented(x: torch.Tensor, kind: str, generator: torch.Generator) -> torch.Tensor:
    """A fresh draw of `kind` (aggregator.start_augment) over a batch of images: a random shift
    by up to an eighth of the side (zero padded: the mean after normalization) and/or a mirror."""
    if kind == "none":
        return x
    if "flip" in kind:
        mirror = torch.rand(len(x), generator=generator) < 0.5
        x = torch.where(mirror[:, None, None, None], x.flip(3), x)
    if "crop" in kind:
        h, w = x.shape[-2:]
        pad = max(1, min(h, w) // 8)
        padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
        out = torch.empty_like(x)
        shifts = torch.randint(0, 2 * pad + 1, (len(x), 2), generator=generator)
        for (i, j) in shifts.unique(dim=0).tolist():  # at most (2 pad + 1)^2 groups, not one copy per image
            rows = ((shifts[:, 0] == i) & (shifts[:, 1] == j)).nonzero().squeeze(1)
            out[rows] = padded[rows, :, i:i + h, j:j + w]
        x = out
    return x


def _cache_name(cfg: Config, model_name: str, public: torch.Tensor, labels: torch.Tensor) -> str:
    from fedmq import models, training

    a = cfg.aggregator
    code = [Path(m.__file__).read_bytes() for m in (models, training)] + [Path(__file__).read_bytes()]
    made_by = disk_cache.digest(model_name, model_spec(model_name).hash, *code, torch.__version__,
                                str(torch.get_num_threads()), str(a.start_epochs), str(a.pretrain_lr),
                                a.start_augment, public.contiguous().numpy().tobytes(),
                                labels.contiguous().numpy().tobytes())
    return f"{model_spec(model_name).public_name[:120]}-{made_by}.f32"


def _test_set(data: RotatedClusters) -> tuple[torch.Tensor, torch.Tensor]:
    test = data.test_data
    idx = np.sort(np.random.default_rng(0x53544152).permutation(len(test))[:TEST_IMAGES])
    return test.x[idx], test.y[idx]


def start_model(cfg: Config, data: RotatedClusters, model_name: str) -> StartModel:
    """The start model of `cfg`'s public images: from the disk cache, else trained (and cached
    where it trained every epoch within aggregator.start_max_seconds)."""
    public = data.public()
    xt, yt = _test_set(data)
    name = _cache_name(cfg, model_name, public.x, public.y)
    kept = cached_vectors("start", name, 1, model_spec(model_name).numel)
    if kept is not None:
        (vector,) = kept
        accuracy = evaluate(model_name, vector, xt, yt)[0]
        event(log, "start.ready", model=model_name, public_images=len(public), accuracy=round(accuracy, 4),
              cached=str(disk_cache.entry_path("start", name)))
        return StartModel(vector, accuracy, 0.0, True)
    a = cfg.aggregator
    event(log, "start.training", PROGRESS, model=model_name, public_images=len(public), epochs=a.start_epochs,
          augment=a.start_augment, budget_s=a.start_max_seconds or "none")
    t0 = time.monotonic()
    last = t0
    vector = to_vector(build_model(model_name, seed=0))
    generator = torch.Generator().manual_seed(0)
    complete = True
    loss = math.nan
    for epoch in range(a.start_epochs):
        lr = a.pretrain_lr * 0.5 * (1 + math.cos(math.pi * epoch / a.start_epochs))
        left = a.start_max_seconds - (time.monotonic() - t0) if a.start_max_seconds else None
        if left is not None and left <= 0:
            complete = False
            break
        result = fit(model_name, vector, augmented(public.x, a.start_augment, generator), public.y, epochs=1,
                     batch_size=BATCH, lr=lr, momentum=0.9, weight_decay=WEIGHT_DECAY, seed=epoch, max_seconds=left)
        vector, loss = result.vector, result.final_loss
        if result.stopped_early:
            complete = False
            break
        now = time.monotonic()
        done = epoch + 1
        eta = (now - t0) / done * (a.start_epochs - done)
        if a.start_max_seconds:
            eta = min(eta, a.start_max_seconds - (now - t0))
        level = PROGRESS if now - last >= PROGRESS_EVERY_S or done == a.start_epochs else logging.INFO
        if level == PROGRESS:
            last = now
        event(log, "start.epoch", level, epoch=f"{done}/{a.start_epochs}", loss=round(result.final_loss, 4),
              seconds=round(now - t0, 1), left_s=round(max(0.0, eta)))
    seconds = time.monotonic() - t0
    warn_if_stuck("start", loss, model_name, a.pretrain_lr)
    if not complete:
        event(log, "start.budget_spent", logging.WARNING, seconds=round(seconds, 1), budget_s=a.start_max_seconds,
              hint="raise aggregator.start_max_seconds (0: no limit) or lower aggregator.start_epochs")
    else:
        disk_cache.write("start", name, vector.numpy().astype(np.float32).tobytes())
    accuracy = evaluate(model_name, vector, xt, yt)[0]
    event(log, "start.ready", PROGRESS, model=model_name, public_images=len(public), accuracy=round(accuracy, 4),
          seconds=round(seconds, 1), **({"cached": str(disk_cache.entry_path("start", name))} if complete else {}))
    return StartModel(vector, accuracy, seconds, False)


def write_start(vector: torch.Tensor, model_name: str, out: str) -> None:
    """`out` as `--init` reads it: a torch state dict (.pt) or the raw float32 vector (.f32)."""
    if out.endswith(INIT_VECTOR_SUFFIX):
        atomic_write(out, vector.numpy().astype("<f4").tobytes())
        return
    import io

    buffer = io.BytesIO()
    torch.save(load_vector(build_model(model_name), vector).state_dict(), buffer)
    atomic_write(out, buffer.getvalue())


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p, ("dataset", "data_dir", "download", "model", "log_level"))
    p.add_argument("--public-images", type=int, metavar="N",
                   help="train images held as public data (data.public_images; default: 10000, or a fifth "
                        "of the train split where that is less)")
    p.add_argument("--epochs", type=int, metavar="N", help="epochs (aggregator.start_epochs; default 15)")
    p.add_argument("--max-seconds", type=float, metavar="S",
                   help="time budget (aggregator.start_max_seconds; default 600, 0: none)")
    p.add_argument("--out", metavar="FILE", required=True,
                   help=f"where to write it: a torch state dict (.pt) or the float32 vector ({INIT_VECTOR_SUFFIX})")



def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, {"public_images": "data.public_images", "epochs": "aggregator.start_epochs",
                                  "max_seconds": "aggregator.start_max_seconds"})
    setup_logging(cfg.log.level, cfg.log.json, auto="progress")
    if not args.out.endswith((".pt", ".pth", INIT_VECTOR_SUFFIX)):
        raise UsageError(f"--out {args.out}: name a .pt (torch state dict) or {INIT_VECTOR_SUFFIX} file")
    if os.path.exists(args.out):
        raise UsageError(f"--out {args.out} exists; remove it or name another file (nothing is overwritten)")
    parent = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(parent):
        raise UsageError(f"--out {args.out}: no directory {parent}")
    fit_model(cfg)  # a folder dataset's model, from its images, as the aggregator picks it
    model_name = resolve_model_name(cfg.model, cfg.data.dataset)
    if not cfg.data.public_images:
        cfg.data.public_images = AUTO_PUBLIC
    data = clusters_from_settings(cfg.data, 1, seed=cfg.seed)
    start = start_model(cfg, data, model_name)
    write_start(start.vector, model_name, args.out)
    print(f"wrote {args.out}: {model_name} trained on {len(data.public())} public {cfg.data.dataset} images, "
          f"accuracy {start.accuracy:.3f} on {min(TEST_IMAGES, len(data.test_data))} unrotated test images"
          f"{' (from the cache)' if start.cached else f' in {start.seconds:.0f} s'}; "
          f"start a fleet from it with --init {args.out}", flush=True)
    return 0
