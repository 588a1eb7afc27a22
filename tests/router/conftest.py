"""The tiny random model the router tests' replicas serve."""

from __future__ import annotations

import pytest
from replicas import save_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny-model")))
