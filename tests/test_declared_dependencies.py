"""Every third-party module that kvserve or its tests import is declared in pyproject.toml.

A module that only a developer's machine happens to have passes every other test there and
fails on a fresh install; this test fails first, wherever it runs.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("kvserve", "tests")
FIRST_PARTY = {"kvserve", "tests"}

# Import names that differ from the distribution that provides them.
DISTRIBUTION_OF = {"yaml": "pyyaml", "PIL": "pillow", "sklearn": "scikit-learn"}

# Imported but deliberately not declared, each with the reason.
NOT_DECLARED = {
    # tests/fixtures/quantized/make_fixtures.py, run by hand to write the committed GPTQ
    # and AWQ fixtures with the reference packers; the test run reads only its outputs.
    "auto_gptq",
    "awq",
}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _declared_distributions() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    # "name[extra]>=1.0; marker" -> name
    return {_normalize(re.match(r"[A-Za-z0-9_.-]+", r.strip()).group(0)) for r in requirements}


def _is_local(top: str, importer: Path) -> bool:
    """A sibling module of the importing file (tests import helpers that way)."""
    return (importer.parent / f"{top}.py").exists() or (importer.parent / top).is_dir()


@functools.cache
def _third_party_imports() -> dict[str, set[str]]:
    """Top-level module -> files importing it, for every absolute import that is neither
    the standard library nor first-party."""
    found: dict[str, set[str]] = {}
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if (
                        top in sys.stdlib_module_names
                        or top in FIRST_PARTY
                        or _is_local(top, path)
                    ):
                        continue
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_imported_module_is_declared():
    declared = _declared_distributions()
    undeclared = {
        module: sorted(files)
        for module, files in _third_party_imports().items()
        if module not in NOT_DECLARED
        and _normalize(DISTRIBUTION_OF.get(module, module)) not in declared
    }
    assert not undeclared, (
        "imported but not declared in pyproject.toml (add to [project.dependencies], the "
        f"test extra, or NOT_DECLARED with a reason): {undeclared}"
    )


def test_the_scan_sees_known_imports():
    """Guards the scanner itself: modules the code is known to import are found."""
    imports = _third_party_imports()
    for module in ("torch", "triton", "fastapi", "scipy", "pytest"):
        assert module in imports, module
    assert "kvserve" not in imports and "os" not in imports


def test_allow_list_has_no_stale_entries():
    imports = _third_party_imports()
    assert NOT_DECLARED <= set(imports), NOT_DECLARED - set(imports)
