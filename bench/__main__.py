"""Run the benchmarks: every module bench/bench_NAME.py with `run(quick: bool) -> dict`.

    python -m bench                 # all
    python -m bench codecs broker   # some
    python -m bench --quick         # smaller sizes, for a smoke run

Each result is written to bench/results/NAME.json with the machine it ran on, so figures
from different machines (CPU here, a GPU box elsewhere) can sit side by side.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
import time
from pathlib import Path

from fedmq.errors import ArgumentParser, run_main
from fedmq.host import describe_host

RESULTS = Path(__file__).resolve().parent / "results"


def available() -> list[str]:
    here = Path(__file__).resolve().parent
    return sorted(m.name[len("bench_"):] for m in pkgutil.iter_modules([str(here)])
                  if m.name.startswith("bench_"))


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (default all: {', '.join(available())})")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON files go")
    args = parser.parse_args(argv)
    names = args.names or available()
    unknown = sorted(set(names) - set(available()))
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(available())}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        module = importlib.import_module(f"bench.bench_{name}")
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        figures = module.run(quick=args.quick)
        doc = {"benchmark": name, "quick": args.quick, "wall_s": round(time.perf_counter() - t0, 2),
               "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": describe_host(), "figures": figures}
        path = args.out / f"{name}.json"
        path.write_text(json.dumps(doc, indent=2) + "\n")
        print(json.dumps(figures, indent=2))
        print(f"-> {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_main("python -m bench", main))
