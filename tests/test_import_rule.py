"""The package's layers import downward only (DESIGN.md, "Layout and the import rule"), read
from the source (ast) of every module under kvserve/, imports inside functions and
TYPE_CHECKING blocks included:

* kvserve/ops is a leaf: torch, triton, numpy, the standard library and other kvserve.ops
  modules, and of the rest of kvserve only kvserve.envs (plain data, standard library only,
  which the kernels read their environment variables from).
* kvserve/core (block pool, KV cache manager, scheduler) knows no engine, model executor or
  HTTP server.
* Only kvserve/entrypoints imports kvserve.entrypoints: the CLI and the server are the top.
* kvserve/router imports nothing of kvserve but itself: it talks HTTP to its workers.
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvserve"

# What a kvserve.ops module may import besides the standard library and kvserve.ops itself.
OPS_THIRD_PARTY = {"torch", "triton", "numpy"}
OPS_KVSERVE = {"kvserve.envs"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imported(path: Path, name: str) -> set[str]:
    """The modules `path` (module `name`) imports: for `from a import b`, a.b where that is a
    module, else a."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}") else base)
    return found


@functools.cache
def _imports() -> dict[str, set[str]]:
    """Module name -> the modules it imports, for every module under kvserve/."""
    return {_module_name(path): _imported(path, _module_name(path)) for path in sorted(PACKAGE.rglob("*.py"))}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _violations(importers: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(f"{module} imports {imported}" for module, imports in _imports().items()
                  if _within(module, importers) for imported in imports
                  if any(_within(imported, package) for package in forbidden))


def test_every_module_is_read() -> None:
    modules = _imports()
    assert "kvserve.ops.attention.paged_attention" in modules and "kvserve.core.sched.scheduler" in modules
    assert "kvserve.envs" in modules["kvserve.ops.pdl"]


def test_ops_imports_nothing_of_kvserve_but_ops_and_envs() -> None:
    violations = sorted(
        f"{module} imports {imported}" for module, imports in _imports().items() if _within(module, "kvserve.ops")
        for imported in imports
        if _within(imported, "kvserve") and not _within(imported, "kvserve.ops") and imported not in OPS_KVSERVE
    )
    assert violations == []


def test_ops_imports_only_torch_triton_numpy_and_the_standard_library() -> None:
    allowed = OPS_THIRD_PARTY | set(sys.stdlib_module_names) | {"__future__", "kvserve"}
    violations = sorted(f"{module} imports {imported}" for module, imports in _imports().items()
                        if _within(module, "kvserve.ops") for imported in imports
                        if imported.partition(".")[0] not in allowed)
    assert violations == []


def test_core_imports_no_engine_model_executor_or_entrypoints() -> None:
    assert _violations("kvserve.core", ("kvserve.engine", "kvserve.model_executor", "kvserve.entrypoints")) == []


def test_only_entrypoints_import_entrypoints() -> None:
    violations = [violation for violation in _violations("kvserve", ("kvserve.entrypoints",))
                  if not violation.startswith("kvserve.entrypoints")]
    assert violations == []


def test_router_imports_nothing_of_kvserve_but_itself() -> None:
    """The router talks HTTP to its workers: no engine (nor torch) loads in its process."""
    violations = sorted(
        f"{module} imports {imported}" for module, imports in _imports().items()
        if _within(module, "kvserve.router") for imported in imports
        if (_within(imported, "kvserve") and not _within(imported, "kvserve.router")
            and imported != "kvserve") or imported.partition(".")[0] in ("torch", "triton"))
    assert violations == []
