"""The docs point at things that exist: every relative link in a tracked *.md file resolves
(the file, and the #anchor where it names one in a Markdown file), every config key a doc
names in backticks (`section.key`) is a key of fedmq/config.py, every project module or name
it names in backticks (`aggregator.personalize`, `sim.ablation.targets_table`) is defined, and
every project file path it mentions exists. `check_docs` is the checker; the last test plants
a broken link to show that it fails."""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
from functools import cache
from pathlib import Path

from fedmq import config

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fedmq", "aggregator", "edge_agent", "sim", "soak", "bench", "scripts", "tests")
PATH_ROOTS = (*PACKAGES, "docs", "results", "deploy", "broker_config", "recipes")

LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)|!\[[^\]\n]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
CONFIG_KEY = re.compile(r"^([a-z_]+)\.([a-z_0-9]+)(?:\s*=.*)?$")
DOTTED = re.compile(rf"^((?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_][A-Za-z_0-9]*)+)(?:\(\))?$")
FILE_PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(PATH_ROOTS)})/[\w./-]*\w\.(?:py|md|conf|toml|json|yml|yaml|txt|csv|png|service))\b")


def tracked_markdown() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", "*.md"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / p for p in out.decode().split("\0") if p and (ROOT / p).is_file()]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|__", "", heading.strip()).lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
        out.update(re.findall(r'<a (?:name|id)="([^"]+)"', line))
    return frozenset(out)


def config_keys() -> dict[str, set[str]]:
    root = config.Config()
    keys: dict[str, set[str]] = {}
    for f in dataclasses.fields(root):
        value = getattr(root, f.name)
        if dataclasses.is_dataclass(value):
            keys[f.name] = {g.name for g in dataclasses.fields(value)}
    return keys


@cache
def module_names(module: str) -> frozenset[str] | None:
    """Top-level names of a project module (and `Class.member` for its classes), or None."""
    base = ROOT.joinpath(*module.split("."))
    path = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
    if not path.is_file():
        return None
    names: set[str] = {p.stem for p in base.glob("*.py")} | {p.name for p in base.glob("*/")}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(f"{node.name}.{item.name}")
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        names.add(f"{node.name}.{item.target.id}")
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


@cache
def code_strings() -> frozenset[str]:
    """Every string literal in the project's code: event, metric and log names among them."""
    out: set[str] = set()
    for package in PACKAGES:
        if package == "tests":
            continue
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) < 80:
                    out.add(node.value)
    return frozenset(out)


def python_name_exists(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        names = module_names(".".join(parts[:i]))
        if names is not None:
            rest = ".".join(parts[i:])
            return not rest or rest in names
    return False


def _prose(text: str) -> str:
    """The text outside fenced code blocks (commands are checked by test_documented_commands)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def check_docs(files: list[Path], root: Path = ROOT) -> list[str]:
    """Every broken reference in `files`, one line each as `file: what`."""
    keys = config_keys()
    problems: list[str] = []
    for path in files:
        rel = path.relative_to(root) if path.is_relative_to(root) else path
        prose = _prose(path.read_text())
        for m in LINK.finditer(prose):
            target = m.group(1) or m.group(2)
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                problems.append(f"{rel}: link to {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{rel}: link to {target}: no heading #{anchor} in {dest.name}")
        for span in CODE_SPAN.findall(prose):
            span = span.strip()
            key = CONFIG_KEY.match(span)
            if key and key.group(1) in keys:
                if (key.group(2) not in keys[key.group(1)] and not python_name_exists(span)
                        and span not in code_strings()):  # a module, or an event or metric name
                    problems.append(f"{rel}: config key `{key.group(1)}.{key.group(2)}` does not exist")
                continue
            name = DOTTED.match(span)
            if name and not python_name_exists(name.group(1)):
                problems.append(f"{rel}: `{name.group(1)}` names no module or name of this project")
        bare = re.sub(r"\]\([^)\s]+\)", "]", prose)  # link targets were checked above
        paths = {m.group(1) for m in FILE_PATH.finditer(bare)}
        paths |= {s.strip().split()[0].rstrip("/") for s in CODE_SPAN.findall(bare)
                  if re.match(rf"^(?:{'|'.join(PATH_ROOTS)})/[\w./*-]+/?$", s.strip().split()[0] if s.strip() else "")}
        for found in sorted(paths):
            if re.search(r"/[A-Z_]+\b|\$", found) or ignored(found):  # a placeholder (NAME.json), or output
                continue
            if not any(next(base.glob(found), None) for base in (root, path.parent)):
                problems.append(f"{rel}: path {found} does not exist")
    return problems


@cache
def ignored(rel: str) -> bool:
    """A path git ignores: what a documented command writes (deploy/creds/, st/), not a file to check."""
    return subprocess.run(["git", "check-ignore", "-q", rel], cwd=ROOT).returncode == 0


def test_every_reference_in_the_docs_resolves() -> None:
    files = tracked_markdown()
    assert any(p.name == "README.md" for p in files) and len(files) > 10, files
    problems = check_docs(files)
    assert not problems, "broken references in the docs:\n" + "\n".join(problems)


def test_the_checker_fails_on_a_planted_broken_reference(tmp_path: Path) -> None:
    good = tmp_path / "good.md"
    good.write_text("# Title\n\n## A section\n\ntext\n")
    bad = tmp_path / "bad.md"
    bad.write_text("# Bad\n\nSee [the guide](missing.md), [a section](good.md#no-such-heading),\n"
                   "[fine](good.md#a-section), `cdfl.no_such_key`, `cdfl.beta0`,\n"
                   "`aggregator.personalize.no_such_function` and `aggregator.personalize`.\n")
    problems = check_docs([good, bad], tmp_path)
    assert len(problems) == 4, problems
    assert any("missing.md" in p for p in problems)
    assert any("#no-such-heading" in p for p in problems)
    assert any("cdfl.no_such_key" in p for p in problems)
    assert any("no_such_function" in p for p in problems)
    assert not check_docs([good], tmp_path)
    bad.write_text("The outputs are in `results/no-such-run` and docs/no_such_page.md.\n")
    assert len(check_docs([bad], tmp_path)) == 2, check_docs([bad], tmp_path)
