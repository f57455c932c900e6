"""The kernel's import graph: loading a config stays torch-free, and config imports nothing that
imports it back (a circle works only while one side imports lazily, and any import that
closes it early fails with a half-initialized module)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL = ROOT / "fedmq"


def test_loading_a_config_imports_no_torch(tmp_path):
    """What every config-loading command does before its own work (`fedmq fleet status` needs
    no torch): load a file naming a dataset and a model, apply flags and `--data-dir`, check."""
    (tmp_path / "MNIST" / "raw").mkdir(parents=True)  # a data root that holds mnist
    config = tmp_path / "fleet.toml"
    config.write_text('model = "cnn28"\n[data]\ndataset = "Fashion-MNIST"\n[broker]\nurl = "mqtt://h:1884"\n')
    script = f"""
import argparse, json, sys
from fedmq.config import check_config, config_from_args, load_config
cfg = load_config({str(config)!r}, {{"model": "resnet20"}})
check_config(cfg)
args = argparse.Namespace(config=None, set=["seed=3"], data_dir={str(tmp_path)!r}, model="cnn28", dataset=None)
from_flags = config_from_args(args)
print(json.dumps({{"dataset": [cfg.data.dataset, from_flags.data.dataset], "model": [cfg.model, from_flags.model],
                  "heavy": sorted(m for m in ("torch", "numpy", "torchvision", "paho") if m in sys.modules)}}))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.splitlines()[-1])
    assert seen["dataset"] == ["Fashion-MNIST", "mnist"]  # the second found under --data-dir
    assert seen["model"] == ["resnet20", "cnn28"]
    assert seen["heavy"] == []


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The kernel modules `path` imports anywhere (module level, in functions, under
    TYPE_CHECKING), each with the packages above it, which importing it runs too."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return found & modules


def kernel_import_graph() -> dict[str, set[str]]:
    """Kernel module -> the kernel modules it imports (fedmq/ only: the roles above it are
    imported by name, never statically)."""
    paths = {_module_name(p): p for p in KERNEL.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        parts = name.split(".")
        running = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}  # itself and its packages
        graph[name] = _imports(path, set(paths)) - running
    return graph


def _path_to(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """One import chain from `start` to `goal` (breadth first), or None."""
    came: dict[str, str | None] = {start: None}
    todo = [start]
    while todo:
        here = todo.pop(0)
        for nxt in sorted(graph.get(here, ())):
            if nxt == goal:
                chain = [goal, here]
                while came[chain[-1]] is not None:
                    chain.append(came[chain[-1]])  # type: ignore[arg-type]
                return chain[::-1]
            if nxt not in came:
                came[nxt] = here
                todo.append(nxt)
    return None


def test_config_imports_nothing_that_imports_it_back():
    graph = kernel_import_graph()
    assert "fedmq.config" in graph["fedmq.data.sources"]  # the graph sees real edges
    circle = _path_to(graph, "fedmq.config", "fedmq.config")
    assert circle is None, "import circle: " + " -> ".join(circle or [])


def test_no_kernel_module_imports_itself_back():
    graph = kernel_import_graph()
    circles = [" -> ".join(c) for m in sorted(graph) if (c := _path_to(graph, m, m))]
    assert not circles, "import circles: " + "; ".join(circles)


def test_the_name_tables_config_needs_import_only_the_ground():
    """dataset_names and broker_urls are what config reaches for at load: they stay below it."""
    graph = kernel_import_graph()
    ground = {"fedmq", "fedmq.errors", "fedmq.redact", "fedmq.service_logins"}
    for name in ("fedmq.dataset_names", "fedmq.broker_urls"):
        assert name in graph
        reached = {m for m in graph if _path_to(graph, name, m)}
        assert reached <= ground, f"{name} reaches {sorted(reached - ground)}"


def test_planning_a_privacy_budget_imports_no_torch():
    """`fedmq privacy plan` is arithmetic on the accountant: it pays no torch import (~2 s)."""
    script = ("import sys\nfrom fedmq import privacy_cli\n"
              "print(sorted(m for m in ('torch', 'torchvision', 'paho') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"
