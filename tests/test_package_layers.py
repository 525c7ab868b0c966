"""The package arrows point down (docs/architecture.md, "Packages"): read from the imports of
every module, top-level and deferred alike, so a new back-arrow fails here before review."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Each unit may import only the units after it in this order (and itself).
ORDER = [
    "pdserve",
    "router",
    "prefill_node",
    "decode_node",
    "kv_transfer",
    "common/__init__.py",  # the offline API's facade (`from common import LLM`), lazy
    "common.node",
    "common.engine",
    "common.text",
    "common.model",
    "common.protocol",
    "common",  # common/envs.py: environment variables and logging set-up
]
ROLES = {"pdserve", "router", "prefill_node", "decode_node"}


def unit_of(module: str) -> str | None:
    for unit in ORDER:
        if unit.endswith(".py"):
            continue
        if module == unit or module.startswith(unit + "."):
            return unit
    return None


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def arrows() -> set[tuple[str, str, str]]:
    """(importing unit, imported unit, file) for every import between two units."""
    out = set()
    for unit in ORDER:
        if unit.endswith(".py"):
            files = [ROOT / unit]
        elif unit == "common":
            files = [ROOT / "common/envs.py"]
        else:
            files = (ROOT / unit.replace(".", "/")).rglob("*.py")
        for path in files:
            for name in imports_of(path):
                target = unit_of(name)
                if target is not None and target != unit:
                    out.add((unit, target, str(path.relative_to(ROOT))))
    return out


def test_every_arrow_points_down():
    up = [(src, dst, file) for src, dst, file in arrows() if ORDER.index(dst) < ORDER.index(src)]
    assert up == []


def test_common_imports_no_transport_and_no_role():
    bad = [
        (src, dst, file)
        for src, dst, file in arrows()
        if src.startswith("common") and (dst == "kv_transfer" or dst in ROLES)
    ]
    assert bad == []
