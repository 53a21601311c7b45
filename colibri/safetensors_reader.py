"""Deprecated name of :mod:`colibri.checkpoint.safetensors`, kept for one
release: the safetensors header reader moved there."""

from colibri.checkpoint import safetensors
from colibri.checkpoint.safetensors import *  # noqa: F401,F403

__all__ = list(safetensors.__all__)
