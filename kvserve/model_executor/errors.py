from __future__ import annotations


class ModelLoadError(ValueError):
    """A model could not be loaded; the message names the file and the problem."""
