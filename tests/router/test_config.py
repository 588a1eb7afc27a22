"""router.yaml: models to worker URLs; malformed files fail naming the line."""

from __future__ import annotations

import pytest

from kvserve.router.config import WorkerSpec, load_config, specs_from_urls


def _load(tmp_path, text: str) -> list[WorkerSpec]:
    path = tmp_path / "router.yaml"
    path.write_text(text)
    return load_config(str(path))


def test_models_map_to_workers(tmp_path):
    specs = _load(tmp_path, "models:\n  a: [http://h1:8000/, http://h2:8000/v1]\n  b:\n    - http://h1:8000\n")
    assert specs == [WorkerSpec("http://h1:8000", frozenset({"a", "b"})),
                     WorkerSpec("http://h2:8000", frozenset({"a"}))]


@pytest.mark.parametrize("text, line, words", [
    ("models:\n  a: [http://h1:8000\n", 3, "expected"),
    ("models:\n  a:\n    - ftp://h1\n", 3, "not an http"),
    ("models:\n  a: []\n", 2, "no worker URLs"),
    ("workers:\n  a: [http://h1:8000]\n", 1, "unknown key"),
    ("models:\n  a:\n    - {url: http://h1}\n", 3, "expected a worker URL"),
])
def test_malformed_files_name_the_line(tmp_path, text, line, words):
    with pytest.raises(ValueError, match=rf"line {line}: .*{words}"):
        _load(tmp_path, text)


def test_worker_flags():
    assert specs_from_urls(["http://h:1/", "http://h:1"]) == [WorkerSpec("http://h:1", None)]
    with pytest.raises(ValueError, match="not an http"):
        specs_from_urls(["h:1"])
