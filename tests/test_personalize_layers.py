"""Head-only replies (cdfl.personalize_layers): the cut below the classifier, the lower part's
features, and a reply that trains the head alone over them, on real digits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from aggregator.cdfl import cdfl_evaluator, cdfl_personalizer
from aggregator.evaluator import FEATURE_CACHE_ENTRIES, LayerSplit, NotSplittable, ProxyEvaluator
from aggregator.personalize import (
    DistillPersonalizer,
    PersonalizeRequest,
    alpha_mixture,
    resolve_layers,
)
from aggregator.reply_jobs import reply_digest
from fedmq.config import CDFLSettings, ConfigError
from fedmq.models import ModelSpec, build_model, model_spec, resolve_model_name, to_vector

ARCH = "digits-cnn"
SPEC = model_spec(ARCH)
K = 2


@pytest.fixture(scope="module")
def world(world_of_two_rotations):
    """test_personalize.py's two rotation clusters of real digits: specialists, proxy sets."""
    _, specialists, proxies = world_of_two_rotations
    return specialists, proxies


def head_personalizer(evaluator: ProxyEvaluator, **options) -> DistillPersonalizer:
    return DistillPersonalizer(evaluator, epochs=2, kd_weight=0.0, start="mixture", rho=0.1,
                               layers="head", **options)


def test_the_cut_is_below_the_trailing_linear_layers_and_reproduces_the_model(world):
    _, proxies = world
    evaluator = ProxyEvaluator(SPEC, proxies)
    split = evaluator.layer_split()
    assert split.names == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert split.numel == sum(p.numel() for n, p in evaluator.module.named_parameters() if n.startswith("fc"))
    vector = to_vector(build_model(ARCH, seed=3))
    x = proxies[1][0][:40]
    with torch.inference_mode():
        whole = torch.func.functional_call(evaluator.module, SPEC.unflatten(vector), (x,))
        cut = split.logits(vector[split.index], vector, split.features(vector, x, 16))
    torch.testing.assert_close(cut, whole, rtol=1e-5, atol=1e-5)


def test_a_torchvision_model_is_cut_below_its_classifier():
    name = resolve_model_name("torchvision:mobilenet_v3_small", "shapes")
    spec = model_spec(name)
    split = LayerSplit(build_model(name, seed=0).eval(), spec, torch.device("cpu"))
    assert split.names == ["classifier.0.weight", "classifier.0.bias", "classifier.3.weight", "classifier.3.bias"]
    assert split.numel < spec.param_numel / 2  # most of the model is below the cut


class Skip(nn.Module):
    """A linear head whose output also adds a value from below the cut: no cut is possible."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.fc = nn.Linear(2 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        return self.fc(h.flatten(1)) + h.mean()


class AllConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 10, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).flatten(1)


def spec_of_module(module: nn.Module) -> ModelSpec:
    named = list(module.named_parameters())
    return ModelSpec("test", tuple(n for n, _ in named), tuple(tuple(p.shape) for _, p in named), (1, 8, 8), 10)


@pytest.mark.parametrize(("module", "why"), [(Skip(), "reads a value below the cut"),
                                             (AllConv(), "no linear head")])
def test_a_model_that_cannot_be_cut_is_refused_with_the_reason(module, why):
    with pytest.raises(NotSplittable, match=why):
        LayerSplit(module.eval(), spec_of_module(module), torch.device("cpu"))


def test_a_head_reply_moves_the_head_alone_lowers_the_proxy_loss_and_is_deterministic(world):
    specialists, proxies = world
    evaluator = ProxyEvaluator(SPEC, proxies)
    personalizer = head_personalizer(evaluator)
    assert personalizer.layers == "head"
    alpha = [0.7, 0.3]
    request = PersonalizeRequest(specialists, alpha, None, seed=5)
    out, info = personalizer.personalize(request)
    again, _ = personalizer.personalize(PersonalizeRequest(specialists, alpha, None, seed=5))
    assert torch.equal(out, again)
    start = alpha_mixture(specialists, alpha)  # as the reply computes it: a hand-written 0.7 a + 0.3 b
    assert torch.allclose(start, 0.7 * specialists[0] + 0.3 * specialists[1])  # rounds otherwise on some CPUs
    index = personalizer.split.index
    lower = torch.ones(SPEC.numel, dtype=torch.bool)
    lower[index] = False
    assert torch.equal(out[lower], start[lower])  # the lower part is the plain mixture
    assert not torch.equal(out[index], start[index])
    assert info["layers"] == "head" and info["steps"] > 0
    weights = torch.tensor(alpha)
    assert float(evaluator.losses(out[None])[0] @ weights) < float(evaluator.losses(start[None])[0] @ weights)


def test_a_worker_job_gives_the_aggregators_head_reply(world):
    """A reply worker holds no clusters, only the fixed start: the same head reply."""
    specialists, proxies = world
    personalizer = head_personalizer(ProxyEvaluator(SPEC, proxies))
    here = PersonalizeRequest(specialists, [0.4, 0.6], None, seed=2)
    personalizer.fix_start(here)
    assert here.start is not None
    there = PersonalizeRequest(torch.empty(0), [0.4, 0.6], None, seed=2, start=here.start.clone(), start_info={})
    torch.testing.assert_close(personalizer.personalize(here)[0], personalizer.personalize(there)[0])
    many = personalizer.personalize_many([here, there])
    torch.testing.assert_close(many[0][0], many[1][0])


def test_features_are_cached_per_start_and_rows_and_bounded(world):
    specialists, proxies = world
    evaluator = ProxyEvaluator(SPEC, proxies)
    rows = torch.arange(evaluator.x.shape[0])
    first = evaluator.lower_features(specialists[0], rows)
    assert torch.equal(evaluator.lower_features(specialists[0], rows), first)
    assert (evaluator.feature_hits, evaluator.feature_misses) == (1, 1)
    evaluator.lower_features(specialists[0], rows[:100])  # other rows: another entry
    for k in range(FEATURE_CACHE_ENTRIES):
        evaluator.lower_features(specialists[1] + k, rows)
    assert evaluator.feature_misses == 2 + FEATURE_CACHE_ENTRIES
    assert len(evaluator._features) == FEATURE_CACHE_ENTRIES
    part = evaluator.lower_features(specialists[1], rows[150:])
    assert float(part[:150].abs().sum()) == 0.0 and float(part[150:].abs().sum()) > 0.0


def test_auto_trains_every_layer_of_a_small_model_and_the_head_of_a_large_one(world):
    _, proxies = world
    evaluator = ProxyEvaluator(SPEC, proxies)
    assert resolve_layers(evaluator, "auto", CDFLSettings().personalize_head_above)[1] == "all"
    split, layers, why = resolve_layers(evaluator, "auto", SPEC.param_numel - 1)
    assert layers == "head" and split is not None and "parameters >" in why
    assert resolve_layers(evaluator, "all", 0)[:2] == (None, "all")
    with pytest.raises(ValueError, match="personalize_layers must be one of"):
        resolve_layers(evaluator, "top", 0)


def test_the_default_reply_of_a_small_model_is_todays(world):
    """cdfl.personalize_layers = auto leaves the digits and cnn28 fleets' replies as they were."""
    specialists, proxies = world
    settings = CDFLSettings(clusters=K, personalize_epochs=1, personalize_min_steps=0)
    evaluator = cdfl_evaluator(SPEC, proxies, settings, "cpu")
    default = cdfl_personalizer(settings, evaluator)
    every = cdfl_personalizer(CDFLSettings(clusters=K, personalize_epochs=1, personalize_min_steps=0,
                                           personalize_layers="all"), evaluator)
    assert default.layers == "all"
    request = PersonalizeRequest(specialists, [0.5, 0.5], None, seed=1)
    assert torch.equal(default.personalize(request)[0], every.personalize(request)[0])
    assert model_spec("cnn28").param_numel <= CDFLSettings().personalize_head_above


def test_bad_layer_settings_are_one_line_config_errors(world):
    _, proxies = world
    evaluator = ProxyEvaluator(SPEC, proxies)
    with pytest.raises(ConfigError, match="cdfl.personalize_layers must be all, head or auto"):
        cdfl_personalizer(CDFLSettings(clusters=K, personalize_layers="top"), evaluator)
    with pytest.raises(ConfigError, match="cdfl.personalize_head_above must be >= 0"):
        cdfl_personalizer(CDFLSettings(clusters=K, personalize_head_above=-1), evaluator)


def test_workers_with_another_layer_setting_get_no_jobs(world):
    _, proxies = world
    evaluator = ProxyEvaluator(SPEC, proxies)
    head = reply_digest(head_personalizer(evaluator), evaluator)
    every = reply_digest(DistillPersonalizer(evaluator, epochs=2, kd_weight=0.0, start="mixture", rho=0.1,
                                             layers="all"), evaluator)
    assert head != every
