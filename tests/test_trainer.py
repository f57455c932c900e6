"""Local training on rotated digits: proximal pull, determinism, real gains, FedSoft's alpha."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from edge_agent.trainer import (
    estimate_alpha_argmin,
    evaluate,
    train_fedsoft,
    train_local,
)
from fedmq.data import load_dataset
from fedmq.models import build_model, model_spec, resolve_model_name, to_vector
from fedmq.training import fit

MODEL = "digits-cnn"


@pytest.fixture(scope="module")
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled 8x8 digits as (N, 1, 8, 8) in [0, 1], shuffled once."""
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    return x[perm], y[perm]


def rotated_mixture(x: torch.Tensor, y: torch.Tensor, share_upright: float, seed: int):
    """Each sample upright with probability `share_upright`, else rotated by 180 degrees."""
    flip = torch.from_numpy(np.random.default_rng(seed).random(len(y)) >= share_upright)
    out = x.clone()
    out[flip] = torch.rot90(x[flip], 2, dims=(-2, -1))
    return out, y, flip


@pytest.fixture(scope="module")
def partly_trained(digits) -> torch.Tensor:
    """A model after a few epochs on 300 digits in both rotations: far from converged."""
    x, y = digits
    gx = torch.cat([x[:300], torch.rot90(x[:300], 2, dims=(-2, -1))])
    gy = torch.cat([y[:300], y[:300]])
    start = to_vector(build_model(MODEL, seed=0))
    return train_local(MODEL, start, gx, gy, epochs=4, lr=0.05, rho=0.0, seed=1).vector


def test_proximal_term_pulls_toward_received_model(digits, partly_trained) -> None:
    x, y = digits
    lx, ly, _ = rotated_mixture(x[600:1400], y[600:1400], 0.7, seed=0)
    u = partly_trained
    free = train_local(MODEL, u, lx, ly, rho=0.0, seed=0).vector
    held = train_local(MODEL, u, lx, ly, rho=100.0, seed=0).vector
    d_free, d_held = float((free - u).norm()), float((held - u).norm())
    print(f"||v - u||: rho=0 {d_free:.4f}, rho=100 {d_held:.4f}")
    assert d_held < 0.25 * d_free


def test_unstable_rho_and_lr_are_refused(digits, partly_trained) -> None:
    x, y = digits
    with pytest.raises(ValueError, match="unstable"):
        train_local(MODEL, partly_trained, x[:64], y[:64], rho=1e4, lr=0.01)


def test_deterministic_given_seed(digits, partly_trained) -> None:
    x, y = digits
    a = train_local(MODEL, partly_trained, x[:400], y[:400], seed=3)
    b = train_local(MODEL, partly_trained, x[:400], y[:400], seed=3)
    c = train_local(MODEL, partly_trained, x[:400], y[:400], seed=4)
    assert torch.equal(a.vector, b.vector) and a.final_loss == b.final_loss
    assert not torch.equal(a.vector, c.vector)
    assert a.epochs_done == 2 and a.samples_seen == 800 and not a.stopped_early


def test_a_model_with_dropout_trains_the_same_for_the_same_seed() -> None:
    """MobileNetV3's classifier draws dropout masks from torch's global generator: fit seeds
    it, whatever drew from it before, and leaves the caller's stream where it was."""
    name = resolve_model_name("torchvision:mobilenet_v3_small", "shapes")
    data = load_dataset("shapes")
    x, y, start = data.x[:96], data.y[:96], to_vector(build_model(name, seed=0))
    torch.manual_seed(123)
    a = fit(name, start, x, y, epochs=1, seed=5)
    after = torch.rand(3)
    torch.manual_seed(999)
    b = fit(name, start, x, y, epochs=1, seed=5)  # another global stream: the same model
    c = fit(name, start, x, y, epochs=1, seed=6)
    assert torch.equal(a.vector, b.vector)
    assert not torch.equal(a.vector, c.vector)
    torch.manual_seed(123)
    fit(name, start, x, y, epochs=1, seed=5)
    assert torch.equal(torch.rand(3), after)  # the caller's generator is restored


def test_default_training_improves_local_accuracy(digits, partly_trained) -> None:
    x, y = digits
    lx, ly, _ = rotated_mixture(x[600:1400], y[600:1400], 0.7, seed=0)
    tx, ty, _ = rotated_mixture(x[1400:], y[1400:], 0.7, seed=1)
    before, _ = evaluate(MODEL, partly_trained, tx, ty)
    result = train_local(MODEL, partly_trained, lx, ly)
    after, _ = evaluate(MODEL, result.vector, tx, ty)
    print(f"local test accuracy: {before:.3f} -> {after:.3f} with the defaults")
    assert after > before + 0.1


def test_argmin_alpha_recovers_mixture_with_specialists(digits) -> None:
    x, y = digits
    start = to_vector(build_model(MODEL, seed=0))
    upright = train_local(MODEL, start, x[:600], y[:600], epochs=4, lr=0.05, rho=0.0, seed=0).vector
    flipped = train_local(MODEL, start, torch.rot90(x[:600], 2, dims=(-2, -1)), y[:600],
                          epochs=4, lr=0.05, rho=0.0, seed=0).vector
    cx, cy, flip = rotated_mixture(x[600:1400], y[600:1400], 0.7, seed=2)
    true = [1 - float(flip.double().mean()), float(flip.double().mean())]
    alpha = estimate_alpha_argmin(MODEL, [upright, flipped], cx, cy)
    print(f"true {true}, estimated {alpha}")
    assert abs(sum(alpha) - 1) < 1e-9
    assert abs(alpha[0] - true[0]) < 0.15


def test_argmin_alpha_splits_exact_ties(digits) -> None:
    x, y = digits
    w = to_vector(build_model(MODEL, seed=0))
    assert estimate_alpha_argmin(MODEL, [w, w.clone()], x[:50], y[:50]) == [0.5, 0.5]


def test_fedsoft_with_one_cluster_is_local_training(digits, partly_trained) -> None:
    x, y = digits
    a = train_local(MODEL, partly_trained, x[:300], y[:300], rho=0.5, seed=1)
    b = train_fedsoft(MODEL, partly_trained, [partly_trained], [1.0], x[:300], y[:300], rho=0.5, seed=1)
    assert torch.allclose(a.vector, b.vector, atol=1e-6)


def test_fedsoft_proximal_pulls_to_alpha_weighted_models(digits, partly_trained) -> None:
    x, y = digits
    w1 = partly_trained
    w2 = to_vector(build_model(MODEL, seed=9))
    target = 0.25 * w1 + 0.75 * w2
    v = train_fedsoft(MODEL, w1, [w1, w2], [0.25, 0.75], x[:300], y[:300], rho=100.0, epochs=3).vector
    assert float((v - target).norm()) < 0.2 * float((w1 - target).norm())


def test_max_seconds_and_on_epoch_stop_early(digits, partly_trained) -> None:
    x, y = digits
    none = train_local(MODEL, partly_trained, x[:500], y[:500], max_seconds=0.0)
    assert none.stopped_early and none.samples_seen == 0 and none.epochs_done == 0
    assert torch.equal(none.vector, partly_trained)

    seen: list[int] = []
    one = train_local(MODEL, partly_trained, x[:500], y[:500], epochs=5,
                      on_epoch=lambda epoch, loss: seen.append(epoch) or False)
    assert seen == [0] and one.epochs_done == 1 and one.stopped_early and one.samples_seen == 500


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_training_steps_are_torch_optims_bit_for_bit(digits, partly_trained, optimizer) -> None:
    """fedmq.optimizers computes torch.optim's updates (its functional forms): same vectors."""
    from fedmq import training

    x, y = digits
    kwargs = dict(epochs=2, lr=0.01, optimizer=optimizer, weight_decay=1e-4, seed=3)
    ours = training.fit(MODEL, partly_trained, x[:256], y[:256], anchors=[(partly_trained, 0.1)], **kwargs)
    swapped = {"SGD": torch.optim.SGD, "Adam": torch.optim.Adam}
    saved = {name: getattr(training, name) for name in swapped}
    try:
        for name, cls in swapped.items():
            setattr(training, name, lambda params, cls=cls, **kw: cls(params, **kw))
        torchs = training.fit(MODEL, partly_trained, x[:256], y[:256], anchors=[(partly_trained, 0.1)], **kwargs)
    finally:
        for name, cls in saved.items():
            setattr(training, name, cls)
    assert torch.equal(ours.vector, torchs.vector)


def test_a_process_that_trains_and_personalizes_does_not_import_the_compiler() -> None:
    """torch.optim.Optimizer imports torch._dynamo (2-2.4 s of CPU here) in every process that
    trains: agents, aggregators with fine-tuned replies, reply workers (fedmq/optimizers.py)."""
    import subprocess
    import sys

    script = (
        "import sys, torch\n"
        "from sklearn.datasets import load_digits\n"
        "from fedmq.models import build_model, to_vector\n"
        "from fedmq.models import model_spec\n"
        "from fedmq.training import fit\n"
        "from aggregator.evaluator import ProxyEvaluator\n"
        "from aggregator.personalize import PersonalizeRequest, make_personalizer\n"
        "d = load_digits(); x = torch.tensor(d.images[:128], dtype=torch.float32).unsqueeze(1) / 16\n"
        "y = torch.tensor(d.target[:128])\n"
        "v = to_vector(build_model('digits-cnn', seed=0))\n"
        "for opt in ('sgd', 'adam'):\n"
        "    fit('digits-cnn', v, x, y, epochs=1, optimizer=opt)\n"
        "ev = ProxyEvaluator(model_spec('digits-cnn'), [(x[:64], y[:64]), (x[64:], y[64:])])\n"
        "p = make_personalizer('finetune', ev, epochs=1)\n"
        "p.personalize(PersonalizeRequest(clusters=torch.stack([v, v]), alpha=[0.5, 0.5], upload=v))\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch.optim.optimizer') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    # torch.optim's functional updates live beside the Optimizer class: importing them is fine.
    assert "torch._dynamo" not in done.stdout, done.stdout


def conv1_layouts(monkeypatch) -> list[bool]:
    """Whether each forward pass of a model that fedmq.training builds ran conv1 channels-last."""
    from fedmq import training

    seen: list[bool] = []
    real_model_at = training._model_at

    def spy(name, vector):
        model = real_model_at(name, vector)
        model.register_forward_hook(lambda m, i, o: seen.append(m.conv1.weight.stride()[1] == 1))
        return model

    monkeypatch.setattr(training, "_model_at", spy)
    return seen


def test_cpu_training_runs_channels_last_and_trains_what_the_default_layout_does(monkeypatch) -> None:
    """On a CPU the 4-D weights train channels-last (oneDNN's faster path, docs/models.md):
    the same update as torch's default layout up to the order of the arithmetic."""
    from fedmq import training
    from fedmq.models import model_spec, trains_channels_last

    assert trains_channels_last("cpu") and not trains_channels_last("meta")
    spec = model_spec("cnn28")
    start = to_vector(build_model("cnn28", seed=0))
    views = spec.unflatten(start.clone().requires_grad_(True), channels_last=True)
    conv = views["conv1.weight"]  # one input channel: only a forced layout makes conv1's output NHWC
    assert conv.is_contiguous(memory_format=torch.channels_last) and conv.stride()[1] == 1
    assert torch.equal(conv, spec.unflatten(start)["conv1.weight"])
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand((96, *spec.input_shape), generator=g), torch.randint(0, 10, (96,), generator=g)
    seen = conv1_layouts(monkeypatch)
    nhwc = training.fit("cnn28", start, x, y, epochs=1, seed=1).vector
    assert seen and all(seen)
    monkeypatch.setattr(training, "trains_channels_last", lambda device: False)
    nchw = training.fit("cnn28", start, x, y, epochs=1, seed=1).vector
    assert not torch.equal(nhwc, start) and torch.allclose(nhwc, nchw, atol=1e-5, rtol=1e-4)


def test_cpu_scoring_runs_channels_last_and_scores_what_the_default_layout_does(monkeypatch) -> None:
    """evaluate and per_sample_losses run their forward passes channels-last on a CPU too."""
    from fedmq import training

    spec = model_spec("cnn28")
    vector = to_vector(build_model("cnn28", seed=0))
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand((300, *spec.input_shape), generator=g), torch.randint(0, 10, (300,), generator=g)
    seen = conv1_layouts(monkeypatch)
    nhwc = training.evaluate("cnn28", vector, x, y), training.per_sample_losses("cnn28", vector, x, y)
    assert len(seen) == 4 and all(seen)  # 300 samples: two passes each
    monkeypatch.setattr(training, "trains_channels_last", lambda device: False)
    nchw = training.evaluate("cnn28", vector, x, y), training.per_sample_losses("cnn28", vector, x, y)
    assert not any(seen[4:])
    assert nhwc[0][0] == pytest.approx(nchw[0][0], abs=1 / 300) and nhwc[0][1] == pytest.approx(nchw[0][1], rel=1e-5)
    assert torch.allclose(nhwc[1], nchw[1], rtol=1e-4, atol=1e-6)
