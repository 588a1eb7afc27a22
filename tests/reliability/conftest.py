"""The soak suite starts servers the way the server tests do (tests/entrypoints/server_process.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "entrypoints"))
