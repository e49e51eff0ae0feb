"""Workbench methods mixed into DSV4Model (hooks, caches, component replacement)."""
from __future__ import annotations


class WorkbenchMixin:
    """Filled in by dsv4lab.analysis; kept separate so the model files stay about the math."""
