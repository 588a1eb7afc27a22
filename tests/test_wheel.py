"""The wheel that `pip install .` builds holds the whole package, and it runs installed.

The editable install that development and CI use reads kvserve/ in place, so a file left
out of the wheel passes every other test: a package without an __init__.py (setuptools'
package discovery skips it), or a data file that pyproject.toml's package-data does not
name, such as the C++ sources kvserve/ops/cpu compiles its kernels from at run time. This
builds a wheel from a copy of the tree, checks that it holds every file of kvserve/, and
installs it (no dependencies) into a fresh virtualenv that sees this environment's
packages, where it must import from the virtualenv, find its C++ sources and start its CLI.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_NOT_SHIPPED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")


def _run(*command: str | Path, cwd: Path) -> str:
    # PYTHONPATH would put a source tree ahead of the installed copy.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{command} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.slow
def test_wheel_holds_the_package_and_runs_installed(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(ROOT / "kvserve", source / "kvserve", ignore=_NOT_SHIPPED)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    package_files = {p.relative_to(source).as_posix() for p in (source / "kvserve").rglob("*") if p.is_file()}
    assert "kvserve/ops/cpu/csrc/decode_matmul.cpp" in package_files

    dist = tmp_path / "dist"
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", dist, source, cwd=tmp_path)
    (wheel,) = dist.glob("kvserve-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = {name for name in archive.namelist() if name.startswith("kvserve/")}
    assert package_files - in_wheel == set(), "files of kvserve/ missing from the wheel"

    # The dependencies come from this environment through a .pth file of plain paths: unlike
    # --system-site-packages it also works when the tests run in a virtualenv, and the .pth
    # files of those directories (an editable kvserve's import hook) are not run.
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    venv_site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=tmp_path).strip())
    outer = [p for p in [*site.getsitepackages(), site.getusersitepackages()] if os.path.isdir(p)]
    (venv_site / "outer-environment.pth").write_text("".join(f"{p}\n" for p in outer))
    _run(python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "--quiet", wheel,
         cwd=tmp_path)

    report = json.loads(_run(python, "-c", (
        "import json, kvserve, kvserve.entrypoints.cli as cli\n"
        "from kvserve.ops import cpu\n"
        "kvserve.LLM\n"
        "cli.build_parser()\n"
        "print(json.dumps({'package': kvserve.__file__, 'sources': [p.name for p in cpu._SOURCES]}))\n"
    ), cwd=tmp_path))
    assert Path(report["package"]).is_relative_to(venv_site)
    assert report["sources"] == sorted(Path(f).name for f in package_files if f.endswith(".cpp"))
    assert "serve" in _run(venv / "bin" / "kvserve", "--help", cwd=tmp_path)
