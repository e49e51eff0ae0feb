"""dsv4lab: a workbench for triaging DeepSeek-V4 inference (NVFP4 and friends).

Importing does no GPU work; heavy submodules load on first use.
"""
from __future__ import annotations

from importlib import metadata

from .config import DSV4Config, ConfigError, load_config

__all__ = ["DSV4Config", "ConfigError", "load_config", "load", "plan", "__version__"]

try:
    __version__: str = metadata.version("dsv4lab")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"


def load(path=None, **kwargs):
    """Load a DSV4 model (see :func:`dsv4lab.loading.load`)."""
    from .loading import load as _load

    return _load(path, **kwargs)


def plan(config_or_path="v4-pro", **kwargs):
    """Memory plan over GPUs (see :func:`dsv4lab.plan.plan`)."""
    from .plan import plan as _plan

    return _plan(config_or_path, **kwargs)
