"""Scenarios of the CDFL paper (rotated clusters) and a drive through three digit domains.

A scenario decides three things: which clusters exist (`build_clusters`), how an agent's
data is drawn for one upload-download cycle (`draw_cycle`: a new mixture every cycle), and
the defaults that keep it within this machine's means. Every draw takes a numpy Generator
seeded by (run seed, agent, cycle), so an agent's data in cycle c is the same in every run
of the same seed, whatever the thread timing.

- `rotated-digits|mnist|fashionmnist|cifar100|shapes`: cluster k is the dataset rotated by
  k * 360 / K; an agent's mixture is 40-90 % from a random primary cluster (docs/data.md).
  Digits and shapes (generated 32x32 colour) are offline; the others need their files
  under `--data-dir`.
- `realsize-shapes` and `realsize`: the real-size fleet, ResNet-20 (GroupNorm) on 32x32 colour images
  rotated into K = 4 clusters, 20 agents and about 22 uploads each (>= 400 a run), sized
  to finish within the hour per method and seed on a 2-core machine; `realsize-shapes` is
  offline, `realsize` takes data.dataset (CIFAR-10 through --data-dir, a folder dataset).
  `realsize-shapes-mobilenet` is the same fleet with MobileNetV3-small and a pre-training
  large enough to start it, `realsize-mobilenet` that on data.dataset.
- With an explicit `--data-dir`, a scenario made offline runs its fleet on the dataset found
  there (`Scenario.on_data_dir`): a results page's command runs unchanged on other data.
- `digits-domains`: three digit sources, which offline means scikit-learn's digits as
  printed, inverted (a night camera) and bold (dilated strokes: a different pen). A car's
  mixture moves along its route: the share of each domain follows a cosine of the car's
  position, with a per-car phase and speed, so neighbouring cycles have similar mixtures.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from fedmq.config import Config
from fedmq.data import AgentData, RotatedClusters, clusters_from_settings, draw_agent, load_dataset
from fedmq.data.mixtures import sample_agent_data
from fedmq.data.sources import OFFLINE, Dataset, offline_with_data_dir
from fedmq.dataset_names import canonical_dataset, dataset_for_data_dir
from fedmq.errors import UsageError
from fedmq.logs import event, get_logger
from fedmq.model_for_data import fit_model

log = get_logger("sim")

DOMAINS: tuple[str, ...] = ("printed", "inverted", "bold")


@dataclass(frozen=True)
class Scenario:
    name: str
    dataset: str
    """Empty: the config's data.dataset (the generic `rotated` scenario)."""
    kind: str
    """rotated or domains."""
    description: str
    fixed_clusters: int | None = None
    """K when the scenario fixes it (digits-domains: 3)."""
    defaults: tuple[tuple[str, object], ...] = ()
    """Config keys the scenario sets unless the user set them (dotted key, value)."""
    clusters: int = 3
    """K when `--clusters` is not given."""
    agents: int = 0
    """Agents per run when `--agents` is not given (0: 20 * K, the paper's)."""
    updates_per_agent: float = 25.0
    """Mean uploads per agent when `--updates-per-agent` is not given (25: the paper's)."""
    test_samples: int = 300
    """Test samples per agent and cycle when `--test-samples` is not given."""
    cluster_test_samples: int = 0
    """Test images per cluster for the cluster models' checkpoints (RunSpec; 0: the whole split)."""
    on_data_dir: str = ""
    """The scenario that runs this one's fleet on the dataset under an explicit `--data-dir`
    ({dataset} is filled in; empty: refused beside --data-dir)."""


# scikit-learn's digits has 1257 training images: the server's proxy and pre-training sets
# must fit in half of them (the other half is the agents' pool); the demo's sizes.
DIGITS_DEFAULTS = (("data.proxy_per_cluster", 200), ("data.pretrain_per_cluster", 400),
                   ("aggregator.pretrain_epochs", 15))


# ResNet-20 on one core of this 2-core CPU: about 4.5 ms per training sample (forward and
# backward). Agents hold 150-350 samples (2 local epochs), the server's reply trains 2 epochs
# of 128 proxy samples. The fleet starts where a real one does: from a start model trained on
# the server's public images (data.public_images auto: 10,000 unrotated, disjoint from every
# pool; aggregator/start_model.py), from which each cluster specializes for 5 epochs on its
# 300 rotated images. GroupNorm: with batch norm, CDFL's proxy refresh
# (eval mode, cdfl.cluster_refresh_steps) blew the cluster models up within two uploads here.
REALSIZE_DEFAULTS = (("model", "resnet20-gn"), ("data.min_samples", 150), ("data.max_samples", 350),
                     ("data.proxy_per_cluster", 100), ("data.pretrain_per_cluster", 300),
                     ("aggregator.pretrain_epochs", 5), ("data.public_images", -1),
                     # a result must not hang on the machine's speed
                     ("aggregator.pretrain_max_seconds", 0), ("aggregator.start_max_seconds", 0),
                     ("cdfl.personalize_epochs", 2), ("cdfl.personalize_samples", 128))
REALSIZE_FLEET = {"clusters": 4, "agents": 20, "updates_per_agent": 22.0, "test_samples": 100,
                  "cluster_test_samples": 2000}
"""K = 4 and 20 agents of 22 uploads on average: 419-462 uploads a run for seeds 0-4."""

# MobileNetV3-small (1.5 M parameters, batch norm) learns nothing from the ResNet-20 fleet's
# pre-training: at rate 0.05 its shared model ends at chance's loss, and 300 images per cluster
# for 5 epochs are too few steps. 750 per cluster for 20 epochs at 0.01 start its clusters at
# 0.90 on shapes (docs/results_realsize.md); the fleet, replies and agents are the same.
MOBILENET_DEFAULTS = (("model", "torchvision:mobilenet_v3_small"),
                      *((k, v) for k, v in REALSIZE_DEFAULTS
                        if k not in ("model", "data.pretrain_per_cluster", "aggregator.pretrain_epochs")),
                      ("data.pretrain_per_cluster", 750), ("aggregator.pretrain_epochs", 20),
                      ("aggregator.pretrain_lr", 0.01))


SCENARIOS: dict[str, Scenario] = {
    "rotated-digits": Scenario("rotated-digits", "digits", "rotated",
                               "scikit-learn digits (offline), cluster k rotated by k*360/K",
                               defaults=DIGITS_DEFAULTS, on_data_dir="rotated-{dataset}"),
    "rotated-mnist": Scenario("rotated-mnist", "mnist", "rotated", "MNIST rotated by k*360/K"),
    "rotated-fashionmnist": Scenario("rotated-fashionmnist", "fashionmnist", "rotated",
                                     "FashionMNIST rotated by k*360/K"),
    "rotated-cifar100": Scenario("rotated-cifar100", "cifar100", "rotated", "CIFAR-100 rotated by k*360/K"),
    "rotated-shapes": Scenario("rotated-shapes", "shapes", "rotated",
                               "generated 32x32 colour shapes (offline), cluster k rotated by k*360/K: "
                               "the scenario for real-sized models (docs/models.md)", on_data_dir="rotated-{dataset}"),
    "rotated": Scenario("rotated", "", "rotated",
                        "the dataset data.dataset names (--set data.dataset=NAME: folder:NAME or "
                        "module.path:factory too), cluster k rotated by k*360/K", on_data_dir="rotated"),
    "realsize-shapes": Scenario("realsize-shapes", "shapes", "rotated",
                                "the real-size fleet: resnet20-gn on generated 32x32 colour shapes (offline), "
                                "K = 4 rotations, 20 agents, >= 400 uploads a run (docs/simulator.md)",
                                defaults=REALSIZE_DEFAULTS, on_data_dir="realsize", **REALSIZE_FLEET),
    "realsize-shapes-mobilenet": Scenario(
        "realsize-shapes-mobilenet", "shapes", "rotated",
        "the real-size fleet with MobileNetV3-small (torchvision, 1.5 M parameters) and a pre-training "
        "that starts it: 750 images per cluster, 20 epochs at 0.01 (docs/simulator.md)",
        defaults=MOBILENET_DEFAULTS, on_data_dir="realsize-mobilenet", **REALSIZE_FLEET),
    "realsize": Scenario("realsize", "", "rotated",
                         "the real-size fleet on the dataset data.dataset names (cifar10 or svhn through "
                         "--data-dir, folder:NAME): resnet20-gn, K = 4 rotations, >= 400 uploads a run",
                         defaults=REALSIZE_DEFAULTS, on_data_dir="realsize", **REALSIZE_FLEET),
    "realsize-mobilenet": Scenario(
        "realsize-mobilenet", "", "rotated",
        "realsize-shapes-mobilenet's fleet, model and pre-training on the dataset data.dataset names "
        "(the one under --data-dir)", defaults=MOBILENET_DEFAULTS, on_data_dir="realsize-mobilenet",
        **REALSIZE_FLEET),
    "digits-domains": Scenario("digits-domains", "digits", "domains",
                               "digits printed / inverted / bold, mixed along each car's route",
                               fixed_clusters=3, defaults=DIGITS_DEFAULTS),
}


def get_scenario(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise UsageError(f"unknown scenario {name!r}; use one of {', '.join(SCENARIOS)}") from None


DEFAULT_SCENARIO = "rotated-digits"


def resolve_scenario(name: str | None, cfg: Config, data_dir: str | None, dataset_named: bool = False) -> Scenario:
    """The scenario a command runs: the one named, else the rotated scenario of the dataset
    found under an explicit `--data-dir` (config_from_args put it in cfg.data.dataset), else
    rotated-digits.

    A scenario made offline, named beside an explicit `--data-dir`, runs its fleet on the data
    there (`Scenario.on_data_dir`: realsize-shapes -> realsize on the dataset found, which goes
    into cfg.data.dataset), so an experiment's command runs unchanged on other data; with
    `dataset_named` (`config.dataset_named`) on the dataset the command names. One without such
    a twin, or an offline dataset named, is refused: the files would be silently ignored."""
    if name is None:
        name = DEFAULT_SCENARIO
        if data_dir:
            found = f"rotated-{cfg.data.dataset}"
            name = found if found in SCENARIOS else "rotated"
    scenario = get_scenario(name)
    if data_dir and canonical_dataset(scenario.dataset or cfg.data.dataset) in OFFLINE:
        if not scenario.on_data_dir:
            raise UsageError(offline_with_data_dir(f"scenario {name!r}", data_dir))
        dataset = dataset_for_data_dir(cfg.data.dataset if dataset_named else None, data_dir)
        twin = scenario.on_data_dir.format(dataset=dataset)
        scenario = get_scenario(twin if twin in SCENARIOS else "rotated")
        cfg.data.dataset = dataset
        # said at a sim's level where the scenario named is not the one that runs
        event(log, "scenario.data_dir", logging.WARNING if scenario.name != name else logging.INFO, named=name,
              runs=scenario.name, dataset=dataset, data_dir=data_dir)
    return scenario


class DomainClusters(RotatedClusters):
    """Three clusters of one dataset that differ by appearance, not by angle.

    Reuses RotatedClusters' pools (proxy / pretrain / agents never share a base image) and
    replaces the rotation by a domain transform in pixel space, then renormalizes.
    """

    def __init__(self, train: Dataset, test: Dataset, *, seed: int = 0, proxy_per_cluster: int | None = None,
                 pretrain_per_cluster: int | None = None) -> None:
        super().__init__(train, test, len(DOMAINS), seed=seed, angles=[0.0] * len(DOMAINS),
                         proxy_per_cluster=proxy_per_cluster, pretrain_per_cluster=pretrain_per_cluster)
        self.name = f"{train.name}-domains"

    def rotated(self, base: Dataset, cluster: int, idx: np.ndarray, label: str) -> Dataset:
        self._check_cluster(cluster)
        part = base.subset(idx)
        mean = torch.tensor(base.mean).view(1, -1, 1, 1)
        std = torch.tensor(base.std).view(1, -1, 1, 1)
        pixels = part.x * std + mean  # back to [0, 1]
        if DOMAINS[cluster] == "inverted":
            pixels = 1.0 - pixels
        elif DOMAINS[cluster] == "bold":
            pixels = torch.nn.functional.max_pool2d(pixels, 3, stride=1, padding=1)
        x = ((pixels - mean) / std).contiguous()
        return part.with_x(x, name=f"{self.name}/{DOMAINS[cluster]}/{label}")


def apply_defaults(scenario: Scenario, cfg: Config) -> str:
    """Set the scenario's dataset on `cfg` (the generic `rotated` keeps data.dataset), then its
    defaults where `cfg` still holds Config's own, then the model for the dataset's images
    (`fit_model`); returns what the plan says of that model ("" where nothing was chosen)."""
    cfg.data.dataset = scenario.dataset or cfg.data.dataset
    pristine = Config()
    for key, value in scenario.defaults:
        *section, name = key.split(".")  # `model` is a top-level key
        mine, default = (getattr(c, section[0]) if section else c for c in (cfg, pristine))
        if getattr(mine, name) == getattr(default, name):
            setattr(mine, name, value)
    return fit_model(cfg)


def build_clusters(scenario: Scenario, cfg: Config, num_clusters: int) -> RotatedClusters:
    """The scenario's clusters for `cfg.data` (dataset, data_dir, proxy/pretrain sizes)."""
    if scenario.kind == "rotated":
        try:
            return clusters_from_settings(cfg.data, num_clusters, seed=cfg.seed)
        except UsageError:
            raise
        except ValueError as exc:  # server sets that do not fit the dataset: the user's sizes, one line
            raise UsageError(str(exc)) from None
    if num_clusters != len(DOMAINS):
        raise ValueError(f"{scenario.name} has {len(DOMAINS)} clusters, not {num_clusters}")
    d = cfg.data
    train = load_dataset(d.dataset, data_dir=d.data_dir, train=True, download=d.download)
    test = load_dataset(d.dataset, data_dir=d.data_dir, train=False, download=d.download)
    return DomainClusters(train, test, seed=cfg.seed, proxy_per_cluster=d.proxy_per_cluster or None,
                          pretrain_per_cluster=d.pretrain_per_cluster or None)


def route_mixture(position: float, num_clusters: int, sharpness: float = 3.0) -> np.ndarray:
    """Where a car is on its route (in laps) -> a mixture: softmax of cosines, one per domain."""
    angles = 2 * math.pi * (position - np.arange(num_clusters) / num_clusters)
    logits = sharpness * np.cos(angles)
    w = np.exp(logits - logits.max())
    return w / w.sum()


def draw_cycle(scenario: Scenario, clusters: RotatedClusters, cfg: Config, seed: int, agent: int,
               cycle: int, test_samples: int) -> tuple[AgentData, AgentData]:
    """An agent's (train, test) data for one cycle; a pure function of (seed, agent, cycle)."""
    d = cfg.data
    rng = np.random.default_rng([seed, agent, cycle])
    if scenario.kind == "rotated":
        return draw_agent(clusters, rng, min_samples=d.min_samples, max_samples=d.max_samples,
                          primary_min=d.primary_min, primary_max=d.primary_max, test_samples=test_samples)
    route = np.random.default_rng([seed, agent, 0x524F555445])  # the car's route: fixed per car
    phase, speed = route.uniform(0, 1), route.uniform(0.02, 0.1)
    alpha = route_mixture(phase + speed * cycle, clusters.num_clusters)
    n = int(rng.integers(d.min_samples, d.max_samples + 1))
    return (sample_agent_data(clusters, alpha, n, rng, split="train"),
            sample_agent_data(clusters, alpha, test_samples, rng, split="test"))


def describe_plan(scenario_name: str, cfg: Config, clusters: list[int]) -> str:
    """What a run of `scenario_name` at each K would use, checked without running it.

    Loads the scenario's dataset from `cfg.data.data_dir`, lays out its clusters at every K and
    trains the model one step on a batch of them (`check_training_step`), so a `--dry-run`, and
    a run before it writes anything, fails here, in seconds and one line, on a missing dataset,
    an unknown scenario, a dataset too small for its sets, server set sizes that do not fit, or
    a model that does not take the images, instead of an hour into an experiment.
    """
    from aggregator.bootstrap import pretrain_epochs
    from fedmq.models import ZOO, resolve_model_name

    scenario = get_scenario(scenario_name)
    cfg = copy.deepcopy(cfg)
    chosen = apply_defaults(scenario, cfg)
    model = cfg.model
    if chosen:
        model += f" ({chosen})"
    elif model in ZOO:  # a zoo model that does not fit the dataset is refused here, or built for it
        built = resolve_model_name(model, cfg.data.dataset)
        model += f" (built for {cfg.data.dataset}: {built})" if built != model else ""
    elif model == "auto":
        model += f" ({resolve_model_name(model, cfg.data.dataset)})"
    a = cfg.aggregator
    budget = f"{a.pretrain_max_seconds:g} s" if a.pretrain_max_seconds else "no time limit"
    lines = [f"scenario {scenario.name}: {scenario.description}; dataset {cfg.data.dataset}"
             + ("" if canonical_dataset(cfg.data.dataset) in OFFLINE else f" from {cfg.data.data_dir}")
             + f"; model {model}, pre-training {a.pretrain_epochs or 'auto'} epochs at {a.pretrain_lr:g}"
             f" (at most {budget}: aggregator.pretrain_max_seconds)"]
    step = ""
    for k in clusters:
        c = build_clusters(scenario, cfg, k)
        step = step or check_training_step(c, cfg)
        lines.append(f"  K={k}: {len(c.train_data)} train / {len(c.test_data)} test images, per cluster "
                     f"proxy {c.proxy_size}, pretrain {c.pretrain_size} ({pretrain_epochs(a.pretrain_epochs, c.pretrain_size)}"
                     f" epochs), agents' pool {len(c.pool('agents', 0))}"
                     + (" (disjoint base images)" if c.disjoint_clusters else " (base images shared across clusters)")
                     + f"; checkpoints on {min(scenario.cluster_test_samples or len(c.test_data), len(c.test_data))}"
                     " test images")
        if cfg.data.public_images and k == clusters[0]:
            lines.insert(1, f"  start: a model trained on {c.public_size} public unrotated train images, disjoint from "
                            f"every pool, for {a.start_epochs} epochs (data.public_images, aggregator.start_*; kept "
                            f"in the disk cache): every method's clusters specialize from it")
    lines.append(step)
    return "\n".join(lines)


STEP_BATCH = 32
"""Images in the one training step a plan takes: pre-training's batch."""


def check_training_step(clusters: RotatedClusters, cfg: Config) -> str:
    """Train the run's model one step on a batch of cluster 0's pre-training images, as
    pre-training would, and score it: what would stop the run (a shape or class count the model
    does not take, a model that fails to train) stops here, as one UsageError. Returns the
    plan's line on it."""
    from fedmq.models import build_model, model_spec, resolve_model_name, to_vector
    from fedmq.training import evaluate, fit

    name = resolve_model_name(cfg.model, cfg.data.dataset)
    spec = model_spec(name)
    shape, classes, dataset = clusters.image_shape, clusters.num_classes, cfg.data.dataset
    fix = "--set model=NAME names another (docs/models.md), or leave model at auto for the dataset's default"
    if tuple(spec.input_shape) != shape:
        raise UsageError(f"model {name} takes {'x'.join(map(str, spec.input_shape))} inputs; {dataset}'s images "
                         f"are {'x'.join(map(str, shape))}: {fix}")
    if spec.num_classes < classes:
        raise UsageError(f"model {name} has {spec.num_classes} outputs; {dataset} has {classes} classes: {fix}")
    batch = clusters.rotated(clusters.train_data, 0, clusters.pool("pretrain", 0)[:STEP_BATCH], "pretrain")
    x, y = batch.x, batch.y
    t0 = time.perf_counter()
    try:
        result = fit(name, to_vector(build_model(name, seed=cfg.seed)), x, y, epochs=1, batch_size=len(y),
                     lr=cfg.aggregator.pretrain_lr, momentum=0.9, seed=cfg.seed)
        evaluate(name, result.vector, x, y)
    except UsageError:
        raise
    except Exception as exc:  # whatever the model does wrong on this data, said in one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UsageError(f"model {name} failed a training step on {len(y)} {dataset} images: "
                         f"{type(exc).__name__}: {first}; {fix}") from None
    if not math.isfinite(result.final_loss):
        raise UsageError(f"model {name}: one training step on {len(y)} {dataset} images gave a loss of "
                         f"{result.final_loss}; lower aggregator.pretrain_lr (--set aggregator.pretrain_lr=...)")
    return (f"  one training step of the model on {len(y)} images: loss {result.final_loss:.3f} in "
            f"{time.perf_counter() - t0:.2f} s")
