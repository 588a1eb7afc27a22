"""Which worker URLs serve which model: from `--worker` flags or a YAML file.

router.yaml maps model names to worker URLs:

    models:
      SmolLM2-135M-Instruct:
        - http://10.0.0.1:8000
        - http://10.0.0.2:8000
      other-model: [http://10.0.0.3:8000]

Workers given by `--worker` serve whatever their /v1/models lists (read by the health
checks); workers from the file serve the models the file names.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

import yaml


@dataclass(frozen=True)
class WorkerSpec:
    url: str
    # None: learn the models from the worker's /v1/models.
    models: frozenset[str] | None


def normalize_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"worker URL {url!r} is not an http(s)://host:port URL")
    return url.rstrip("/").removesuffix("/v1")


def specs_from_urls(urls: list[str]) -> list[WorkerSpec]:
    return [WorkerSpec(url, None) for url in dict.fromkeys(normalize_url(url) for url in urls)]


def _error(path: str, node: yaml.Node, message: str) -> ValueError:
    return ValueError(f"{path}, line {node.start_mark.line + 1}: {message}")


def _scalar(path: str, node: yaml.Node, what: str) -> str:
    if not isinstance(node, yaml.ScalarNode) or not str(node.value).strip():
        raise _error(path, node, f"expected {what}")
    return str(node.value)


def load_config(path: str) -> list[WorkerSpec]:
    """The workers the file names, each with the models it serves. Errors name the line."""
    with open(path) as f:
        text = f.read()
    try:
        root = yaml.compose(text)
    except yaml.MarkedYAMLError as error:
        line = error.problem_mark.line + 1 if error.problem_mark else "?"
        raise ValueError(f"{path}, line {line}: {error.problem}") from None
    if not isinstance(root, yaml.MappingNode):
        raise ValueError(f"{path}: expected a mapping with the key 'models'")
    models_node = None
    for key, value in root.value:
        if _scalar(path, key, "a key") != "models":
            raise _error(path, key, f"unknown key {key.value!r} (expected 'models')")
        models_node = value
    if not isinstance(models_node, yaml.MappingNode) or not models_node.value:
        raise _error(path, models_node or root, "'models' must map model names to lists of worker URLs")
    models_of: dict[str, set[str]] = {}
    for name_node, urls_node in models_node.value:
        name = _scalar(path, name_node, "a model name")
        url_nodes = urls_node.value if isinstance(urls_node, yaml.SequenceNode) else [urls_node]
        if not url_nodes:
            raise _error(path, urls_node, f"model {name!r} has no worker URLs")
        for url_node in url_nodes:
            try:
                url = normalize_url(_scalar(path, url_node, "a worker URL"))
            except ValueError as error:
                raise _error(path, url_node, str(error)) from None
            models_of.setdefault(url, set()).add(name)
    return [WorkerSpec(url, frozenset(models)) for url, models in models_of.items()]
