"""dsv4lab: a workbench for triaging DeepSeek-V4 inference (NVFP4 and friends).

Importing does no GPU work; heavy submodules load on first use.
"""
from __future__ import annotations

from .config import DSV4Config, ConfigError, load_config

__all__ = ["DSV4Config", "ConfigError", "load_config", "load"]


def load(path=None, **kwargs):
    """Load a DSV4 model (see :func:`dsv4lab.loading.load`)."""
    from .loading import load as _load

    return _load(path, **kwargs)
