"""README's Layout names every module of the package, so a reader finds each file."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _layout() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    found = re.search(r"^## Layout\n\n```\n(.*?)```", text, re.S | re.M)
    assert found, "README.md has no ## Layout block"
    return found.group(1)


def test_every_top_level_module_is_in_the_layout() -> None:
    # Before: held.py, rowwise.py and bridge_calls.py were in the package, not here.
    layout = set(re.findall(r"[\w/]+\.py\b|\w+/", _layout()))
    package = ROOT / "batchgraph"
    modules = {p.name for p in package.glob("*.py") if not p.name.startswith("__")}
    folders = {f"{p.name}/" for p in package.iterdir() if (p / "__init__.py").exists()}
    missing = sorted((modules | folders) - layout)
    assert not missing, f"README.md's Layout does not name {missing}"


def test_every_module_the_layout_names_exists() -> None:
    package = ROOT / "batchgraph"
    named = re.findall(r"\b(\w+\.py)\b", _layout())
    gone = sorted({n for n in named if not (package / n).exists()
                   and not any(package.glob(f"*/{n}"))})
    assert not gone, f"README.md's Layout names {gone}, which the package does not hold"
