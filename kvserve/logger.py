"""How kvserve's processes log: one format, set up by whoever starts a process."""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: int | str) -> None:
    logging.basicConfig(level=level, format=LOG_FORMAT)
