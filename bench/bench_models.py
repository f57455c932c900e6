"""A real-sized model end to end: MobileNetV3-small (torchvision, 1.5 M parameters and batch
norm) on the generated 32x32 colour `shapes` set, as docs/models.md brings it.

1. Bytes: one agent's trained update (1,000 local samples, 2 epochs, the agent's defaults)
   and one reply (another model, as a delta against the one the agent holds), per codec, as
   msgpack wire maps (what the protocol carries).
2. Aggregator seconds per upload for each CDFL reply variant (`CDFL.update`: estimate,
   cluster update, reply), K = 2, 1,000 proxy samples per cluster, this CPU or CUDA: every
   layer trained (the reply before cdfl.personalize_layers) against the default, which trains
   the classifier alone over the frozen lower part's features.
3. Agent: ONNX export and ONNX Runtime against torch inference (bench_agent's measurement).
4. The deployment as a user runs it: `fedmq aggregator` and `fedmq agent` processes with
   their defaults on a real Mosquitto: the aggregator's start (pre-training), the agent's
   upload-to-reply latency, bytes up and down, and the agent's peak memory (VmHWM).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import msgpack
import torch

from bench.bench_agent import onnx_cost
from bench.bench_aggregator import random_world
from bench.bench_replies import VARIANTS, interleaved
from bench.process_memory import status_mb
from fedmq import codecs
from fedmq.broker import MosquittoBroker
from fedmq.data import load_dataset
from fedmq.models import build_model, model_spec, resolve_model_name, to_vector
from fedmq.sketch import data_sketch
from fedmq.training import fit

MODEL = "torchvision:mobilenet_v3_small"
DATASET = "shapes"
BEFORE = "every layer (personalize_layers=all, before)"
REPLY_VARIANTS: dict[str, dict] = {
    "paper (mixture, no refresh)": VARIANTS["paper (mixture, no refresh)"],
    BEFORE: {"personalize_layers": "all"},
    "default (personalize_layers=auto: the head)": {},
    "head, samples256": {"personalize_samples": 256},
}
"""Name -> CDFLSettings fields; the default trains the classifier alone on this 1.5 M-parameter
model (cdfl.personalize_layers = auto), the row before it every layer."""
FROZEN = "frozen backbone (model train=head): the head alone travels"
"""The same model with its backbone frozen (fedmq/backbone.py): a fleet of other vectors (the
classifier's 0.6 M values), whose replies reuse the backbone's proxy features."""


def wire_bytes(name: str) -> dict:
    data = load_dataset(DATASET)
    start = to_vector(build_model(name, seed=0))
    t0 = time.perf_counter()
    trained = fit(name, start, data.x[:1000], data.y[:1000], epochs=2, lr=0.01, momentum=0.9).vector
    out: dict = {"agent_training_s": round(time.perf_counter() - t0, 2), "values": int(trained.numel())}
    # A reply: another model (here trained on other samples) as a delta against the one the agent holds.
    reply = fit(name, start, data.x[1000:2000], data.y[1000:2000], epochs=2, lr=0.01, momentum=0.9).vector
    for codec in codecs.CODECS:
        for what, vector in (("upload", trained), ("reply", reply)):
            wire = codecs.encode(vector.numpy(), codec, base=start.numpy())
            out[f"{what}_{codec}_bytes"] = len(msgpack.packb(wire, use_bin_type=True))
    return out


def reply_costs(name: str, quick: bool, rounds: int | None = None) -> dict:
    """Seconds per upload of each reply row, the rows taking turns (bench_replies.interleaved),
    so `x_default` (time over the every-layer reply's in the same round) holds on a busy machine."""
    from aggregator.cdfl import CDFL
    from aggregator.strategy import Upload
    from fedmq.config import CDFLSettings

    device = "cuda" if torch.cuda.is_available() else "cpu"
    n_proxy = 200 if quick else 1000
    proxies, clusters = random_world(n_proxy, arch=name, k=2)
    sketch = data_sketch(torch.cat([proxies[0][0][:300], proxies[1][0][:100]]))
    out: dict = {"device": device, "torch_threads": torch.get_num_threads(), "K": 2, "proxy_per_cluster": n_proxy,
                 "variants": {}}
    rows = {}
    for variant, fields in REPLY_VARIANTS.items():
        settings = CDFLSettings(clusters=2, tau0=1000, **fields)
        strategy = CDFL.from_settings(model_spec(name), clusters, proxies, settings, device=device)
        strategy.join("warm-up")
        strategy.update(Upload("warm-up", clusters[0] + 0.01, tau=0, sketch=sketch))
        rows[variant] = (strategy, clusters, sketch)
        out["variants"][variant] = {"settings": fields, "layers": getattr(strategy.personalizer, "layers", "-"),
                                    "values": model_spec(name).numel}
    frozen = resolve_model_name(f"{MODEL}?train=head", DATASET)
    frozen_proxies, frozen_clusters = random_world(n_proxy, arch=frozen, k=2)
    strategy = CDFL.from_settings(model_spec(frozen), frozen_clusters, frozen_proxies,
                                  CDFLSettings(clusters=2, tau0=1000), device=device)
    strategy.join("warm-up")
    strategy.update(Upload("warm-up", frozen_clusters[0] + 0.01, tau=0, sketch=sketch))
    rows[FROZEN] = (strategy, frozen_clusters, sketch)
    out["variants"][FROZEN] = {"settings": {"model": frozen}, "layers": strategy.personalizer.layers,
                               "values": model_spec(frozen).numel}
    for variant, figures in interleaved(rows, rounds or (1 if quick else 3), device, BEFORE).items():
        out["variants"][variant].update(figures)
        print(f"reply {variant:44s} {figures['s_per_upload']:8.2f} s/upload x{figures['x_default']:.3f}", flush=True)
    return out


def _wait(proc: subprocess.Popen, lines: list[str], pattern: str, timeout: float) -> re.Match[str]:
    regex = re.compile(pattern)
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"exited before {pattern!r}:\n" + "".join(lines[-20:]))
        lines.append(line)
        match = regex.search(line)
        if match:
            return match
    raise RuntimeError(f"no {pattern!r} in {timeout:.0f} s:\n" + "".join(lines[-20:]))


def deployment(quick: bool, settings: Sequence[str] = ()) -> dict:
    """`fedmq aggregator` + one `fedmq agent` with MobileNetV3-small, defaults (and the
    aggregator's `settings`, KEY=VALUE), over Mosquitto."""
    fedmq = str(Path(sys.executable).parent / "fedmq")
    extra = ["--set", "data.pretrain_per_cluster=200", "--set", "aggregator.pretrain_epochs=1"] if quick else []
    for setting in settings:
        extra += ["--set", setting]
    with MosquittoBroker.dev() as broker, tempfile.TemporaryDirectory() as tmp:
        common = ["--broker", broker.url, "--fleet", "bench-models", "--dataset", DATASET, "--model", MODEL]
        popen = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, "cwd": tmp}
        t0 = time.perf_counter()
        agg = subprocess.Popen([fedmq, "aggregator", *common, "--clusters", "2", "--state-dir", f"{tmp}/agg",
                                *extra], **popen)
        agent = None
        agg_lines: list[str] = []
        agent_lines: list[str] = []
        try:
            _wait(agg, agg_lines, r"^aggregator cdfl on ", 1800)
            started = time.perf_counter() - t0
            agent = subprocess.Popen([fedmq, "agent", *common, "--id", "van-1", "--state-dir", f"{tmp}/van-1"],
                                     **popen)
            _wait(agent, agent_lines, r"model\.installed .*via=join", 600)
            agent.send_signal(signal.SIGUSR1)
            trained = _wait(agent, agent_lines, r"train\.done .* seconds=([0-9.]+) .*acc_held=([0-9.]+) "
                            r"acc_trained=([0-9.]+)", 600)
            done = _wait(agent, agent_lines, r"model\.installed .*via=update .*accuracy=([0-9.]+) .*"
                         r"uploaded=(\d+) waited_s=([0-9.]+) downloaded=(\d+)", 1200)
            applied = _wait(agg, agg_lines, r"update\.applied .* apply_s=([0-9.]+)", 60)
            agg_peak = round(status_mb("VmHWM", agg.pid), 1)
            # A restart on the same state dir, with the disk cache warm: how soon it serves again.
            agg.terminate()
            agg.wait(120)
            t1 = time.perf_counter()
            agg = subprocess.Popen([fedmq, "aggregator", *common, "--clusters", "2", "--state-dir", f"{tmp}/agg",
                                    *extra], **popen)
            _wait(agg, agg_lines, r"^aggregator cdfl on ", 600)
            restarted = time.perf_counter() - t1
            return {"aggregator_settings": list(settings), "aggregator_start_s": round(started, 1),
                    "aggregator_restart_s": round(restarted, 1),
                    "agent_resends": sum("upload.waiting" in line for line in agent_lines),
                    "agent_training_s": float(trained.group(1)),
                    "agent_accuracy_held_trained_received": [float(trained.group(2)), float(trained.group(3)),
                                                             float(done.group(1))],
                    "upload_bytes": int(done.group(2)), "reply_bytes": int(done.group(4)),
                    "upload_to_reply_s": float(done.group(3)), "aggregator_apply_s": float(applied.group(1)),
                    "agent_peak_rss_mb": round(status_mb("VmHWM", agent.pid), 1), "aggregator_peak_rss_mb": agg_peak}
        finally:
            for proc in (agent, agg):
                if proc is not None and proc.poll() is None:
                    proc.terminate()
                    proc.wait(60)


def run(quick: bool = False) -> dict:
    name = resolve_model_name(MODEL, DATASET)
    spec = model_spec(name)
    out: dict = {"model": name, "parameters": spec.param_numel, "statistics": spec.numel - spec.param_numel,
                 "fp32_mb": round(spec.numel * 4 / 2**20, 2)}
    out["bytes"] = wire_bytes(name)
    print(f"bytes {out['bytes']}", flush=True)
    out["replies"] = reply_costs(name, quick)
    out["agent_onnx"] = onnx_cost(quick, name)
    print(f"onnx {out['agent_onnx']}", flush=True)
    out["deployment"] = deployment(quick)
    print(f"deployment {out['deployment']}", flush=True)
    return out


if __name__ == "__main__":
    import argparse
    import json
    import os

    from fedmq.host import describe_host

    parser = argparse.ArgumentParser(description="one part of the benchmark alone, merged into the results "
                                                 "file: the deployment (aggregator + agent --update-now) as "
                                                 "figures.deployment_rerun, or the reply rows as figures.replies_rerun")
    parser.add_argument("--part", choices=("deployment", "replies"), default="deployment")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the reply rows (--part replies)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="aggregator setting (--part deployment)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "models.json")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    load = round(os.getloadavg()[0], 1)
    if args.part == "replies":
        figures = reply_costs(resolve_model_name(MODEL, DATASET), False, args.rounds)
    else:
        figures = deployment(False, args.set)
    print(json.dumps(figures, indent=2), flush=True)
    doc = json.loads(args.out.read_text()) if args.out.exists() else {"figures": {}}
    doc.setdefault("figures", {})[f"{args.part}_rerun"] = {**figures, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                                           "load_before": load, "machine": describe_host()}
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
