"""kvserve.envs: every environment variable kvserve reads is read there, when it is asked for."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvserve import envs

ROOT = Path(__file__).resolve().parent.parent

# Modules that touch the environment other than through kvserve.envs, and why.
OTHER_ENVIRONMENT_USES = {
    "kvserve/envs.py": "reads every variable",
    "kvserve/entrypoints/cli.py": "sets GOMP_SPINCOUNT before torch loads",
    "kvserve/benchmarks/cpu_compare.py": "hands its environment on to the servers it starts",
    "kvserve/router/launch.py": "shares out the GPUs of CUDA_VISIBLE_DEVICES among the replicas it starts, "
                                "handing its environment on to them (the router imports nothing of kvserve)",
}


def _environment_uses(path: Path) -> list[int]:
    """Lines of `path` that use os.environ or os.getenv, or import either from os."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
                and isinstance(node.value, ast.Name) and node.value.id == "os"):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                alias.name in ("environ", "getenv") for alias in node.names):
            lines.append(node.lineno)
    return lines


def test_environment_variables_are_read_in_envs_only() -> None:
    found = {}
    for path in sorted((ROOT / "kvserve").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        if name not in OTHER_ENVIRONMENT_USES and (lines := _environment_uses(path)):
            found[name] = lines
    assert found == {}, f"read these through kvserve.envs: {found}"


def test_variables_are_read_when_asked_for(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("KVSERVE_PDL", raising=False)
    assert envs.KVSERVE_PDL is True
    monkeypatch.setenv("KVSERVE_PDL", "0")
    assert envs.KVSERVE_PDL is False
    monkeypatch.delenv("KVSERVE_CACHE_DIR", raising=False)
    assert envs.KVSERVE_CACHE_DIR == Path.home() / ".cache" / "kvserve"
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    assert envs.KVSERVE_CACHE_DIR == tmp_path
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert envs.TRITON_INTERPRET is True
    monkeypatch.delenv("TRITON_INTERPRET")
    assert envs.TRITON_INTERPRET is False


def test_every_variable_has_a_value_and_nothing_else_does() -> None:
    for name in dir(envs):
        getattr(envs, name)
    assert set(dir(envs)) == set(envs.environment_variables)
    with pytest.raises(AttributeError, match="KVSERVE_NO_SUCH_VARIABLE"):
        envs.KVSERVE_NO_SUCH_VARIABLE  # noqa: B018

