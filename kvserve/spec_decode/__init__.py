"""Speculative decoding: propose draft tokens cheaply, verify them in one target pass."""

from kvserve.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
