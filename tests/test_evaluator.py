"""The batched proxy evaluator agrees with a plain nn.Module, and its cluster cache refreshes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import aggregator.evaluator as evaluator_module
from aggregator.estimators import fedsoft_argmin_alpha
from aggregator.evaluator import NotFusable, ProxyEvaluator
from fedmq.models import ZOO, ZooEntry, build_model, model_spec, spec_of, to_vector


def random_vectors(arch: str, m: int) -> torch.Tensor:
    # Trained-looking scale: zoo init plus noise, so logits are not all near zero.
    g = torch.Generator().manual_seed(1)
    base = torch.stack([to_vector(build_model(arch, seed=i)) for i in range(m)])
    return base + 0.05 * torch.randn(base.shape, generator=g)


def proxy_sets(arch: str, k: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    spec = model_spec(arch)
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(n, *spec.input_shape, generator=g), torch.randint(0, spec.num_classes, (n,), generator=g))
            for _ in range(k)]


@pytest.mark.parametrize("arch", ["digits-cnn", "cnn28", "cnn32"])
@pytest.mark.parametrize("formulation, channels_last",
                         [("fused", None), ("stacked", True), ("stacked", False), ("vmap", False)])
def test_batched_losses_equal_the_naive_path(arch, formulation, channels_last):
    spec = model_spec(arch)
    # 3 x 50 samples in chunks of 16: the last chunk of the concatenation is short
    ev = ProxyEvaluator(spec, proxy_sets(arch, 3, 50), device="cpu", chunk=16,
                        formulation=formulation, channels_last=channels_last)
    assert ev.formulation == formulation
    vectors = random_vectors(arch, 4)
    batched = ev.losses(vectors)
    assert batched.shape == (4, 3)
    naive = torch.tensor([[ev.losses_naive(vectors[m], k) for k in range(3)] for m in range(4)])
    torch.testing.assert_close(batched, naive, rtol=0, atol=1e-5)
    assert (batched[0] != batched[1]).all()  # different models, different losses


def test_accuracies_and_per_sample_results_match_a_module():
    arch = "digits-cnn"
    proxies = proxy_sets(arch, 2, 40)
    ev = ProxyEvaluator(model_spec(arch), proxies, device="cpu")
    v = random_vectors(arch, 1)
    model = build_model(arch)
    torch.nn.utils.vector_to_parameters(v[0], model.parameters())
    with torch.no_grad():
        for k, (x, y) in enumerate(proxies):
            logits = model(x)
            assert ev.accuracies(v)[0, k].item() == pytest.approx((logits.argmax(1) == y).float().mean().item())
            p = torch.softmax(logits, 1).gather(1, y[:, None])[:, 0]
            got = ev.per_sample(v, "p")[0, ev.offsets[k] : ev.offsets[k + 1]]
            torch.testing.assert_close(got, p, rtol=0, atol=1e-5)


def test_gradients_match_autograd_on_a_module():
    arch = "digits-cnn"
    proxies = proxy_sets(arch, 2, 30)
    ev = ProxyEvaluator(model_spec(arch), proxies, device="cpu", batch=7)  # several chunks
    v = random_vectors(arch, 1)[0]
    grads = ev.gradients(v)
    model = build_model(arch)
    torch.nn.utils.vector_to_parameters(v, model.parameters())
    for k, (x, y) in enumerate(proxies):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        torch.testing.assert_close(grads[k], expected, rtol=1e-4, atol=1e-6)


def test_cluster_loss_cache_is_invalidated_when_a_cluster_changes():
    arch = "digits-cnn"
    ev = ProxyEvaluator(model_spec(arch), proxy_sets(arch, 2, 30), device="cpu")
    w = random_vectors(arch, 2)
    first = ev.cluster_losses(w)
    assert ev.cache_misses == 2
    assert torch.equal(ev.cluster_losses(w), first) and ev.cache_hits == 2
    w[1] += 0.1  # content hash changes for cluster 1 only
    second = ev.cluster_losses(w)
    assert ev.cache_misses == 3 and second[0] == first[0] and second[1] != first[1]
    assert second[1].item() == pytest.approx(ev.losses_naive(w[1], 1), rel=1e-6)  # float32 sums, chunked vs whole
    # with version counters the key is the version, not the content
    ev.cluster_losses(w, versions=[5, 5])
    ev.cluster_losses(w, versions=[5, 5])
    ev.cluster_losses(w, versions=[5, 6])
    assert ev.cache_misses == 3 + 2 + 1


def test_fedsoft_argmin_counts_the_winning_cluster_per_sample():
    arch = "digits-cnn"
    spec = model_spec(arch)
    proxies = proxy_sets(arch, 2, 30)
    ev = ProxyEvaluator(spec, proxies, device="cpu")
    w = random_vectors(arch, 2)
    x, y = proxies[0]
    losses = ev.per_sample_on(w, x, y)
    share0 = (losses[0] < losses[1]).float().mean().item()
    assert fedsoft_argmin_alpha(ev, w, x, y) == pytest.approx([share0, 1 - share0])


def test_bad_proxy_shapes_are_refused():
    spec = model_spec("digits-cnn")
    with pytest.raises(ValueError, match="expects"):
        ProxyEvaluator(spec, [(torch.zeros(4, 1, 28, 28), torch.zeros(4, dtype=torch.long))], device="cpu")
    with pytest.raises(ValueError, match="at least one"):
        ProxyEvaluator(spec, [], device="cpu")


def test_fused_is_the_cpu_default_and_splits_work_over_workers_without_changing_results(monkeypatch):
    arch = "cnn28"
    proxies = proxy_sets(arch, 2, 37)
    vectors = random_vectors(arch, 3)
    inline = ProxyEvaluator(model_spec(arch), proxies, device="cpu", chunk=8, workers=1)
    assert inline.formulation == "fused" and inline.workers is None
    threaded = ProxyEvaluator(model_spec(arch), proxies, device="cpu", chunk=8, workers=2)
    assert threaded.workers is not None and threaded.workers.count == 2
    assert torch.get_num_threads() == 1  # the workers' single-threading did not leak here
    expected = inline.per_sample(vectors)
    torch.testing.assert_close(threaded.per_sample(vectors), expected, rtol=0, atol=1e-6)
    stacked = ProxyEvaluator(model_spec(arch), proxies, device="cpu", formulation="stacked")
    torch.testing.assert_close(expected, stacked.per_sample(vectors), rtol=1e-5, atol=1e-5)
    # other data (no cached windows), one cluster's set, and no window cache at all agree too
    x, y = proxies[1]
    torch.testing.assert_close(inline.per_sample_on(vectors, x, y), expected[:, 37:], rtol=0, atol=1e-6)
    assert inline.loss_on(vectors[0], 1) == pytest.approx(stacked.loss_on(vectors[0], 1), rel=1e-5)
    # a cluster's own accuracy (the aggregator's cluster-accuracy metric) is the K x K matrix's diagonal
    matrix = inline.accuracies(vectors[:2])
    assert [inline.accuracy_on(vectors[k], k) for k in range(2)] == pytest.approx(torch.diagonal(matrix).tolist())
    monkeypatch.setattr(evaluator_module, "WINDOW_CACHE_BYTES", 0)
    uncached = ProxyEvaluator(model_spec(arch), proxies, device="cpu", chunk=8, workers=1)
    torch.testing.assert_close(uncached.per_sample(vectors), expected, rtol=0, atol=1e-6)
    assert uncached._windows is None


class AvgPoolNet(nn.Module):
    """Fusable by its layers, but pools by average: the plan's check must refuse it."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.avg_pool2d(torch.relu(self.conv1(x)), 2).flatten(1))


class TanhNet(AvgPoolNet):
    """Has a layer the plan does not know."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__(num_classes)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(self.act(torch.max_pool2d(self.conv1(x), 2)).flatten(1))


@pytest.mark.parametrize("net, why", [(AvgPoolNet, "differs from the module"), (TanhNet, "no fused form")])
def test_models_the_fused_plan_does_not_reproduce_fall_back_to_stacked(monkeypatch, net, why):
    monkeypatch.setitem(ZOO, "test-net", ZooEntry(net, (1, 8, 8), 10))
    spec = spec_of(build_model("test-net"), "test-net")
    proxies = proxy_sets("digits-cnn", 2, 20)
    ev = ProxyEvaluator(spec, proxies, device="cpu")
    assert ev.formulation == "stacked" and ev.plan is None
    v = to_vector(build_model("test-net", seed=3))[None]
    assert ev.losses(v)[0, 1].item() == pytest.approx(ev.losses_naive(v[0], 1), abs=1e-5)
    with pytest.raises(NotFusable, match=why):
        ProxyEvaluator(spec, proxies, device="cpu", formulation="fused")
