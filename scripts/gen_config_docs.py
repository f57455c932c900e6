"""Write docs/config.md from fedmq/config.py: every section, key, default and docstring.

    python scripts/gen_config_docs.py          # rewrite docs/config.md
    python scripts/gen_config_docs.py --check  # exit 1 if docs/config.md is stale (a test runs this)
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fedmq import config  # noqa: E402


def attribute_docs(source: str) -> dict[tuple[str, str], str]:
    """(class, field) -> the string literal that follows the field (PEP 257 attribute docstring)."""
    docs: dict[tuple[str, str], str] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        body = node.body
        for stmt, nxt in zip(body, body[1:], strict=False):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[(node.name, stmt.target.id)] = " ".join(nxt.value.value.split())
    return docs


def render() -> str:
    docs = attribute_docs(Path(config.__file__).read_text())
    lines = [
        "# Configuration reference",
        "",
        "Generated from `fedmq/config.py` by `python scripts/gen_config_docs.py`; do not edit by hand.",
        "",
        "Precedence, lowest first: these defaults, a TOML file (`--config FILE.toml`), a role's",
        "flags (`--broker`, `--fleet`, ...), then `--set section.key=value` (repeatable).",
        "",
        "```toml",
        "fleet = \"garage\"",
        "[broker]",
        "url = \"mqtts://broker.example:8883\"",
        "ca_file = \"/etc/fedmq/ca.crt\"",
        "[cdfl]",
        "beta0 = 0.1",
        "```",
        "",
    ]
    root = config.Config()
    top = [f for f in dataclasses.fields(root) if not dataclasses.is_dataclass(getattr(root, f.name))]
    sections = [f for f in dataclasses.fields(root) if dataclasses.is_dataclass(getattr(root, f.name))]

    def table(obj: object, cls_name: str, prefix: str) -> None:
        lines.append("| key | default | meaning |")
        lines.append("|---|---|---|")
        for f in dataclasses.fields(obj):  # type: ignore[arg-type]
            if dataclasses.is_dataclass(getattr(obj, f.name)):
                continue
            default = getattr(obj, f.name)
            if f.name == "data_dir":
                default = "$FEDMQ_DATA_DIR or ~/.cache/fedmq/data"
            text = docs.get((cls_name, f.name), "")
            lines.append(f"| `{prefix}{f.name}` | `{default!r}` | {text} |")
        lines.append("")

    lines.append("## Top level")
    lines.append("")
    table(root, "Config", "")
    _ = top
    for f in sections:
        obj = getattr(root, f.name)
        cls = type(obj)
        lines.append(f"## [{f.name}]")
        lines.append("")
        if cls.__doc__:
            lines.append(" ".join(cls.__doc__.split()))
            lines.append("")
        table(obj, cls.__name__, f"{f.name}.")
    return "\n".join(lines)


def main() -> int:
    out = ROOT / "docs" / "config.md"
    text = render()
    if "--check" in sys.argv:
        if not out.exists() or out.read_text() != text:
            print("docs/config.md is stale: run python scripts/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
