"""dsv4lab: a workbench for triaging DeepSeek-V4 inference (NVFP4 and friends).

``dsv4lab.load`` (a checkpoint -> WorkbenchModel) and ``dsv4lab.plan`` (memory plans over GPUs)
are the two entry points; importing does no GPU work.
"""
from __future__ import annotations

from importlib import metadata

from . import plan as _plan_module  # noqa: F401  (``dsv4lab.plan`` is that module, made callable)
from .config import ConfigError, DSV4Config, load_config
from .loading import load

__all__ = ["DSV4Config", "ConfigError", "load_config", "load", "plan", "__version__"]

try:
    __version__: str = metadata.version("dsv4lab")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

