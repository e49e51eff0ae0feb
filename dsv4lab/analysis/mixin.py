"""Workbench methods mixed into DSV4Model (hooks, caches, component replacement, comparisons).

Each method is a thin wrapper over a function in ``dsv4lab.analysis`` / ``dsv4lab.bugzoo``;
see docs/hooks.md, docs/components.md and docs/precision.md.
"""
from __future__ import annotations


class WorkbenchMixin:
    """Kept separate so the model files stay about the math."""

    # ------------------------------------------------------------------ hooks
    def hook_schema(self, ids=None, decode: bool = False):
        """DataFrame of every hook point: name, component, layer, order, shape, dtype, meaning."""
        from .hooks import hook_schema

        return hook_schema(self, ids, decode)

    def hooks(self, fwd_hooks=(), strict: bool = True):
        """Context manager: ``with model.hooks([(pattern, fn)]): ...``; fn(tensor, name) may
        return a replacement. Removed on exit (also on exceptions)."""
        from .hooks import hooks

        return hooks(self, fwd_hooks, strict)

    def execution_order(self, ids=None) -> list[str]:
        """Hook names in the order they fire for one forward on ``ids``."""
        import torch

        from .hooks import default_prompt, record_order

        ids = default_prompt(self.config).to(self.device) if ids is None else ids
        with torch.no_grad(), record_order(self) as order:
            self(ids)
        return list(order)

    def run_with_cache(self, ids, names=None, device="cpu", reduce=None, max_bytes=None, **kw):
        """(logits, ActivationCache); see dsv4lab.analysis.cache.run_with_cache."""
        from .cache import run_with_cache

        return run_with_cache(self, ids, names=names, device=device, reduce=reduce, max_bytes=max_bytes, **kw)

    # ------------------------------------------------------------- components
    def components(self, pattern=None):
        """DataFrame: name, kind, class, impl, layer (+ mode/format for linears)."""
        from .components import components

        return components(self, pattern)

    def replace(self, pattern, impl, **kw):
        """Swap the implementation of every component matching ``pattern``; returns a handle
        whose ``restore()`` (or ``with`` exit) puts the originals back."""
        from .components import replace

        return replace(self, pattern, impl, **kw)

    def use_kernels(self, pattern="**", enable: bool = True, **kw) -> int:
        """Switch the matching linears / expert blocks to their kernel (or back to the
        reference with ``enable=False``); see dsv4lab.analysis.components.use_kernels."""
        from .components import use_kernels

        return use_kernels(self, pattern, enable, **kw)

    def restore(self) -> int:
        """Undo every active component replacement."""
        from .components import restore

        return restore(self)

    # ------------------------------------------------------------ comparisons
    def compare(self, other, ids, **kw):
        """compare_runs(self, other, ids); ``other`` = a model or (model, intervention)."""
        from .compare import compare_runs

        return compare_runs(self, other, ids, **kw)

    def precision_sweep(self, ids, **kw):
        from .sweep import ablation_sweep

        return ablation_sweep(self, ids, **kw)

    def precision_floor(self, ids, threshold: float, **kw):
        from .sweep import precision_floor

        return precision_floor(self, ids, threshold, **kw)

    # ---------------------------------------------------------------- bug zoo
    def inject(self, bug: str, layers=None, **kw):
        """Inject a known bug variant (dsv4lab.bugzoo.BUGS); returns a restorable handle."""
        from ..bugzoo import inject

        return inject(self, bug, layers=layers, **kw)
