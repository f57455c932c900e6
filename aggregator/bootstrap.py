"""Build an aggregator from a Config: data, proxy sets, cluster models, strategy, engine.

Cluster models are pre-trained on a few thousand samples per cluster (`data.pretrain_per_
cluster`) starting from one shared initialization, so that their parameter-space mixtures
are meaningful; when the state dir already holds a snapshot they are loaded from it instead.
A user's own weights (`aggregator.init`, `--init FILE`), or the start model trained on the
server's public images (`data.public_images`, aggregator/start_model.py), are that shared start:
the shared pre-training is skipped and each cluster specializes from them.
Proxy sets are drawn from the dataset with the config's seed, so a restarted aggregator
evaluates on exactly the same samples. Pre-trained zoo and torchvision models are kept in the
disk cache (fedmq/disk_cache.py): an aggregator on a fresh state dir with the same data, seed
and settings starts without training them again. Pre-training reports its epochs at the
default log level every PROGRESS_EVERY_S, so a minutes-long start shows how far it got.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from aggregator.cdfl import CDFL
from aggregator.engine import Engine
from aggregator.estimators import SketchEstimator
from aggregator.evaluator import ProxyEvaluator
from aggregator.fedasync import FedAsync
from aggregator.fedbuff import FedBuff
from aggregator.fedsoft_async import FedSoftAsync
from aggregator.journal import Journal
from aggregator.strategy import Strategy
from fedmq import disk_cache
from fedmq.algorithms import ASYNC_SERVER
from fedmq.config import Config
from fedmq.data import RotatedClusters, clusters_from_settings
from fedmq.logs import PROGRESS, event, get_logger
from fedmq.models import (
    ModelSpec,
    build_model,
    load_init_vector,
    model_spec,
    resolve_model_name,
    to_vector,
)
from fedmq.training import TrainResult, fit

log = get_logger("aggregator")
pretrain_log = get_logger("aggregator.pretrain")
"""Pre-training progress: shown at the auto level by every process (fedmq.logs.LONG_WORK)."""


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA device")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}; use auto, cpu or cuda")
    return device


# An auto pretrain_epochs shows each cluster model about this many samples: the paper's
# 2000 per cluster for 5 epochs, so that small datasets get as far as large ones.
PRETRAIN_SAMPLES_SEEN = 10_000

PRETRAIN_MAX_AUTO_EPOCHS = 50
"""Where auto epochs stop: a small pool's loss reaches 0 long before 10,000 samples (on a folder of
500 28x28 images in 5 classes, 0.0001 after 34 epochs), and a pool of 4 would take 2,500 epochs."""


PROGRESS_EVERY_S = 10.0
"""Pre-training reports an epoch at the default (progress) level when this long passed since
its last such line: a real model's minutes of pre-training show, a small one's second does not."""


class PretrainProgress:
    """`fit`'s epoch callback for pre-training: one `pretrain.epoch` line per epoch at info, and
    at the default level at most every PROGRESS_EVERY_S (with the models still to train, and
    the time budget the seconds run against)."""

    def __init__(self, models: int, clock: Callable[[], float] = time.monotonic, budget_s: float = 0.0,
                 work: list[int] | None = None) -> None:
        self.models, self.clock, self.budget_s = models, clock, budget_s
        self.started = self.last = clock()
        self.model = ""
        self.index = 0
        self.epochs = 0
        self.work = work
        """Samples each model is planned to see (epochs x pool): what the end is estimated from."""

    def left_s(self, epoch: int) -> float | None:
        """Seconds to the end of pre-training, from the rate so far, within the time budget;
        None without a plan."""
        if not self.work or not self.epochs or self.index < 1:
            return None
        done = sum(self.work[:self.index - 1]) + self.work[self.index - 1] * (epoch + 1) / self.epochs
        elapsed = self.clock() - self.started
        left = elapsed / max(done, 1e-9) * (sum(self.work) - done)
        return max(0.0, min(left, self.budget_s - elapsed) if self.budget_s else left)

    def next_model(self, name: str, epochs: int) -> None:
        self.model, self.epochs = name, epochs
        self.index += 1

    def __call__(self, epoch: int, loss: float) -> None:
        now = self.clock()
        level = PROGRESS if now - self.last >= PROGRESS_EVERY_S else logging.INFO
        if level == PROGRESS:
            self.last = now
        left = self.left_s(epoch)
        event(pretrain_log, "pretrain.epoch", level=level, model=self.model, of_models=f"{self.index}/{self.models}",
              epoch=f"{epoch + 1}/{self.epochs}", loss=round(loss, 4), seconds=round(now - self.started, 1),
              **({"left_s": round(left)} if left is not None else {}),
              **({"budget_s": self.budget_s} if self.budget_s else {}))


SPECIALIZE_SAMPLES_SEEN = 2_000
"""An auto pretrain_epochs from a trained start (`init`, a start model) shows each cluster about
this many: it specializes a model that already sees, it does not teach one to see. MobileNetV3-
small on shapes' 1,000 per cluster: 2 epochs, seconds, not the minutes of 10."""


def pretrain_epochs(configured: int, samples: int, from_start: bool = False) -> int:
    """`aggregator.pretrain_epochs`, or for 0 (auto) ceil(10,000 / samples) within [5, 50]; from a
    trained start (`from_start`) ceil(2,000 / samples) within [1, 10]."""
    if configured:
        return configured
    if from_start:
        return min(10, max(1, -(-SPECIALIZE_SAMPLES_SEEN // max(samples, 1))))
    return min(PRETRAIN_MAX_AUTO_EPOCHS, max(5, -(-PRETRAIN_SAMPLES_SEEN // max(samples, 1))))


class PretrainBudget:
    """`aggregator.pretrain_max_seconds` over the models pre-training trains, one after another:
    each gets what is left in proportion to the samples it is planned to see (epochs x pool), so
    the shared model, which sees every pool, gets its larger part."""

    def __init__(self, seconds: float, work: list[int], clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds, self.work, self.clock = seconds, work, clock
        self.started = clock()
        self.spent = False
        """Whether a model stopped on its share: the result then depends on this machine's speed."""

    def share(self, model: int) -> float | None:
        """Seconds model `model` (its index in `work`) may train; None: no limit."""
        if not self.seconds:
            return None
        left = self.seconds - (self.clock() - self.started)
        return max(0.0, left * self.work[model] / max(1, sum(self.work[model:])))

    def check(self, name: str, result: TrainResult, epochs: int) -> None:
        """Say where a model stopped on its share, with what to change."""
        if not result.stopped_early:
            return
        self.spent = True
        event(pretrain_log, "pretrain.budget_spent", logging.WARNING, model=name, epochs=f"{result.epochs_done}/{epochs}",
              seconds=round(result.seconds, 1), budget_s=self.seconds,
              hint="raise aggregator.pretrain_max_seconds (0: no limit) or lower aggregator.pretrain_epochs")


def pretrain_clusters(cfg: Config, clusters: RotatedClusters, model_name: str) -> list[torch.Tensor]:
    """One model per cluster, each trained from the same seeded init on its pretrain pool.

    With `aggregator.pretrain_shared` the start is instead one model trained on all pools
    together, and each cluster specializes from it at a lower rate: models fine-tuned from one
    pre-trained model stay linearly connected, so sum_k alpha_k w_k is itself a model.
    """
    pools = [clusters.pretrain(k, cfg.data.pretrain_per_cluster or None) for k in range(clusters.num_clusters)]
    init = load_init_vector(cfg.aggregator.init, model_name) if cfg.aggregator.init else None
    if init is None and cfg.data.public_images:
        from aggregator.start_model import start_model

        init = start_model(cfg, clusters, model_name).vector
    name = _pretrain_cache_name(cfg, model_name, pools, init)
    kept = cached_vectors("pretrain", name, len(pools), model_spec(model_name).numel) if name else None
    if kept is not None:
        event(log, "cluster.pretrained", cluster="all", samples=sum(len(p) for p in pools), cached=name)
        return kept
    vectors, complete = _pretrain(cfg, pools, model_name, init)
    if name and complete:  # one cut by the time budget is this machine's speed, not the settings'
        disk_cache.write("pretrain", name, torch.stack(vectors).numpy().tobytes())
    return vectors


def _pretrain_cache_name(cfg: Config, model_name: str, pools: list, init: torch.Tensor | None = None) -> str | None:
    """Pre-training is a pure function of these (on the CPU, at a given thread count); a
    zoo model, a factory in fedmq.models (the zoo's ResNet-20 built for MNIST) or a torchvision
    one (its version fixes the code: a MobileNetV3's pre-training takes many minutes on 2
    cores), not another factory, whose code may change under the same parameter shapes. The
    spec hash covers a frozen backbone's weights, which its file may change under one path."""
    from fedmq import models, training

    code = [Path(m.__file__).read_bytes() for m in (models, training)] + [Path(__file__).read_bytes()]
    reference = models.parse_reference(model_name) if models.is_reference(model_name) else None
    if reference is not None and reference.source == "torchvision":
        import torchvision

        code.append(f"torchvision {torchvision.__version__}".encode())
    elif model_name not in models.ZOO and (reference is None or not reference.source.startswith(f"{models.__name__}:")):
        return None
    spec = model_spec(model_name)
    code.append(spec.hash.encode())
    data = [t.contiguous().numpy().tobytes() for p in pools for t in (p.x, p.y)]
    if init is not None:
        data.append(init.numpy().tobytes())
    made_by = disk_cache.digest(model_name, *code, torch.__version__, str(torch.get_num_threads()),
                                str(cfg.seed), str(cfg.aggregator.pretrain_shared),
                                str(cfg.aggregator.pretrain_epochs), str(cfg.aggregator.pretrain_lr), *data)
    # The readable part without a backbone file's path (a '/' would make it a directory) and
    # short enough for a file name; the digest carries the rest.
    return f"{spec.public_name[:120]}-k{len(pools)}-{made_by}.f32"


def cached_vectors(kind: str, name: str, k: int, numel: int) -> list[torch.Tensor] | None:
    """k model vectors kept in the disk cache under `kind/name` (pre-trained clusters, a start
    model), or None: absent, damaged, or of another size (then a warning names the file)."""
    payload = disk_cache.read(kind, name)
    if payload is None:
        return None
    if len(payload) != 4 * k * numel:
        event(log, "cache.refused", logging.WARNING, path=str(disk_cache.entry_path(kind, name)),
              error=f"{len(payload)} bytes, not {k} models of {numel} floats")
        return None
    return list(torch.from_numpy(np.frombuffer(payload, np.float32).copy()).view(k, numel))


SPECIALIZE_SLOWER = 5.0
"""Clusters specialize from a trained start (the shared model, `init`) at pretrain_lr / this."""

STUCK_SHARE = 0.95
"""A cluster model whose last pre-training loss is above this share of chance's (ln of the
class count) has not learned: ResNet-20 on shapes-lit at 0.05 ends at chance. Only the
clusters are judged: MobileNetV3's shared model ends at 2.27 against ln 10 = 2.30 at 0.05,
yet its clusters specialize from it to 0.49, better than from a shared model trained at 0.01."""


def warn_if_stuck(cluster: int | str, loss: float, model_name: str, lr: float) -> None:
    """Log `cluster.pretrain_stuck` where a pre-training ended at chance's loss: every reply
    and every agent would start from a model that predicts nothing, silently otherwise."""
    chance = math.log(model_spec(model_name).num_classes)
    if loss >= STUCK_SHARE * chance or math.isnan(loss):
        event(log, "cluster.pretrain_stuck", logging.WARNING, cluster=cluster, loss=loss, chance=chance, lr=lr,
              hint="the model learned nothing at this rate: lower aggregator.pretrain_lr (or give more epochs)")


def _pretrain(cfg: Config, pools: list, model_name: str,
              init: torch.Tensor | None = None) -> tuple[list[torch.Tensor], bool]:
    """Each cluster's model from the shared start: `init` (a user's weights, which stand for
    the shared pre-training), else a seeded init, trained on all pools first with
    `aggregator.pretrain_shared`; and whether every model trained all its epochs (none was
    stopped by `aggregator.pretrain_max_seconds`)."""
    start = to_vector(build_model(model_name, seed=cfg.seed)) if init is None else init
    rate = cfg.aggregator.pretrain_lr
    lr = rate if init is None else rate / SPECIALIZE_SLOWER
    train_shared = cfg.aggregator.pretrain_shared and init is None
    if init is not None:
        event(log, "cluster.init", path=cfg.aggregator.init or "start model (data.public_images)",
              values=init.numel())
    # Epochs of the shared model by all pools together: it sees as many samples as one
    # cluster model does, not K times as many (compose and the demo wait for it).
    shared_samples = sum(len(p) for p in pools) if train_shared else 0
    plan = ([pretrain_epochs(cfg.aggregator.pretrain_epochs, shared_samples)] if train_shared else []) + [
        pretrain_epochs(cfg.aggregator.pretrain_epochs, len(p), from_start=init is not None) for p in pools]
    sizes = ([shared_samples] if train_shared else []) + [len(p) for p in pools]
    work = [e * n for e, n in zip(plan, sizes, strict=True)]
    progress = PretrainProgress(len(pools) + train_shared, budget_s=cfg.aggregator.pretrain_max_seconds, work=work)
    budget = PretrainBudget(cfg.aggregator.pretrain_max_seconds, work)
    event(pretrain_log, "pretrain.start", logging.INFO, model=model_name, models=len(plan),
          epochs=plan, samples=sizes, budget_s=cfg.aggregator.pretrain_max_seconds or "none")
    if train_shared:
        t0 = time.perf_counter()
        x = torch.cat([p.x for p in pools])
        y = torch.cat([p.y for p in pools])
        progress.next_model("shared", plan[0])
        shared = fit(model_name, start, x, y, epochs=plan[0], batch_size=32, lr=lr, momentum=0.9, seed=cfg.seed,
                     on_epoch=progress, max_seconds=budget.share(0))
        budget.check("shared", shared, plan[0])
        event(log, "cluster.pretrained", cluster="shared", samples=len(y),
              seconds=time.perf_counter() - t0, loss=shared.final_loss)
        start, lr = shared.vector, rate / SPECIALIZE_SLOWER
    vectors = []
    for k, data in enumerate(pools):
        t0 = time.perf_counter()
        i = k + train_shared
        progress.next_model(f"cluster {k}", plan[i])
        result = fit(model_name, start, data.x, data.y, epochs=plan[i], batch_size=32, lr=lr, momentum=0.9,
                     seed=cfg.seed + k, on_epoch=progress, max_seconds=budget.share(i))
        budget.check(f"cluster {k}", result, plan[i])
        event(log, "cluster.pretrained", cluster=k, samples=len(data),
              seconds=time.perf_counter() - t0, loss=result.final_loss)
        warn_if_stuck(k, result.final_loss, model_name, lr)
        vectors.append(result.vector)
    return vectors, not budget.spent


ASYNC_STRATEGIES: dict[str, Callable[..., Strategy]] = {
    "cdfl": lambda cfg, spec, clusters, proxies, device: CDFL.from_settings(
        spec, clusters, proxies, cfg.cdfl, device=device, seed=cfg.seed),
    "fedsoft-async": lambda cfg, spec, clusters, proxies, device: FedSoftAsync.from_settings(
        spec, clusters, cfg.cdfl),
    # One global model: start from the mean of the pre-trained cluster models.
    "fedasync": lambda cfg, spec, clusters, proxies, device: FedAsync.from_settings(
        spec, torch.stack(clusters).mean(0), cfg.fedasync),
    "fedbuff": lambda cfg, spec, clusters, proxies, device: FedBuff.from_settings(
        spec, torch.stack(clusters).mean(0), cfg.fedbuff),
}
"""Asynchronous algorithm name -> builder(cfg, spec, cluster vectors, proxy sets, device)."""
assert tuple(ASYNC_STRATEGIES) == ASYNC_SERVER, "fedmq/algorithms.py ASYNC_SERVER and this map must agree"


def make_strategy(cfg: Config, spec: ModelSpec, clusters: list[torch.Tensor],
                  proxies: list[tuple[torch.Tensor, torch.Tensor]], device: str = "cpu",
                  data: RotatedClusters | None = None) -> Strategy:
    """The strategy named by `aggregator.algorithm`, with its knobs from the config; `data`, the
    server's cluster data, gives the sketch estimator its references (`sketch_references`)."""
    algorithm = cfg.aggregator.algorithm
    try:
        build = ASYNC_STRATEGIES[algorithm]
    except KeyError:
        raise ValueError(f"unknown algorithm {algorithm!r}; use {', '.join(ASYNC_STRATEGIES)}") from None
    strategy = build(cfg, spec, clusters, proxies, device)
    estimator = getattr(strategy, "estimator", None)
    if data is not None and isinstance(estimator, SketchEstimator):
        estimator.references = sketch_references(cfg, data, proxies)
    return strategy


def sketch_references(cfg: Config, data: RotatedClusters,
                      proxies: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor] | None:
    """Per cluster, the inputs an upload's data sketch is compared with: the proxy set and, with
    `cdfl.sketch_pretrain`, the pre-training set too (every input the server holds for it);
    None: the proxy sets alone."""
    if not cfg.cdfl.sketch_pretrain:
        return None
    n = cfg.data.pretrain_per_cluster or None
    return [torch.cat([x, data.pretrain(k, n).x]) for k, (x, _) in enumerate(proxies)]


def build_engine(cfg: Config, *, clusters: RotatedClusters | None = None) -> Engine:
    model_name = resolve_model_name(cfg.model, cfg.data.dataset)
    spec = model_spec(model_name)
    K = cfg.cdfl.clusters
    clusters = clusters or clusters_from_settings(cfg.data, K, seed=cfg.seed)
    if clusters.num_clusters != K:
        raise ValueError(f"data has {clusters.num_clusters} clusters, config asks for {K}")
    journal = Journal(cfg.aggregator.state_dir, accept_loss=cfg.aggregator.accept_journal_loss)
    journal.check_writable()  # before pre-training, which takes minutes
    if journal.has_state():
        if cfg.aggregator.init:
            event(log, "init.ignored", logging.WARNING, path=cfg.aggregator.init, state_dir=cfg.aggregator.state_dir,
                  reason="the state dir holds a snapshot: the fleet resumes from it")
        vectors = [to_vector(build_model(model_name, seed=cfg.seed)) for _ in range(K)]
    else:
        vectors = pretrain_clusters(cfg, clusters, model_name)
    proxies = [clusters.proxy(k, cfg.data.proxy_per_cluster or None) for k in range(K)]
    device = resolve_device(cfg.device)
    proxy_sets = [(p.x, p.y) for p in proxies]
    strategy: Strategy = make_strategy(cfg, spec, vectors, proxy_sets, device=device, data=clusters)
    # CDFL evaluates on its proxies anyway; the baselines get an evaluator for the metric only.
    evaluator = getattr(strategy, "evaluator", None) or ProxyEvaluator(
        spec, proxy_sets, device=device, batch=cfg.cdfl.proxy_batch)
    return Engine(strategy, spec, cfg, journal, evaluator=evaluator)
