"""WorkbenchModel: the DSV4 model with the triage methods on it (hooks, caches, swaps, comparisons).

The model package stays about the math and imports nothing above it; this class adds, as thin
methods, the functions of ``dsv4lab.analysis``, ``dsv4lab.precision`` and ``dsv4lab.bugzoo``, so
a notebook can write ``model.run_with_cache(ids)``. ``dsv4lab.load`` and :func:`random_model`
return one; any :class:`~dsv4lab.model.DSV4Model` becomes one in place with :func:`as_workbench`
(a class change, no copy: the full model never exists twice). See docs/hooks.md,
docs/components.md and docs/precision.md.
"""
from __future__ import annotations

import torch

from . import bugzoo
from .analysis import cache, compare, components, hooks
from .config import DSV4Config
from .decode.drivers import check_decode_mode, decoder
from .model import DSV4Model
from .model.init import randomize_
from .model.validate import check_new_tokens, check_state
from .precision import sweep


class WorkbenchModel(DSV4Model):
    """A :class:`DSV4Model` (same modules, same state dict) with the workbench methods."""

    # ------------------------------------------------------------------ hooks
    def hook_schema(self, ids=None, decode: bool = False):
        """DataFrame of every hook point: name, component, layer, order, shape, dtype, meaning."""
        return hooks.hook_schema(self, ids, decode)

    def hooks(self, fwd_hooks=(), strict: bool = True):
        """Context manager: ``with model.hooks([(pattern, fn)]): ...``; fn(tensor, name) may
        return a replacement. Removed on exit (also on exceptions)."""
        return hooks.hooks(self, fwd_hooks, strict)

    def execution_order(self, ids=None) -> list[str]:
        """Hook names in the order they fire for one forward on ``ids``."""
        ids = hooks.default_prompt(self.config).to(self.device) if ids is None else ids
        with torch.no_grad(), hooks.record_order(self) as order:
            self(ids)
        return list(order)

    def run_with_cache(self, ids, names=None, device="cpu", reduce=None, max_bytes=None, **kw):
        """(logits, ActivationCache); see dsv4lab.analysis.cache.run_with_cache."""
        return cache.run_with_cache(self, ids, names=names, device=device, reduce=reduce, max_bytes=max_bytes, **kw)

    # ------------------------------------------------------------- components
    def components(self, pattern=None):
        """DataFrame: name, kind, class, impl, layer (+ mode/format for linears)."""
        return components.components(self, pattern)

    def replace(self, pattern, impl, **kw):
        """Swap the implementation of every component matching ``pattern``; returns a handle
        whose ``restore()`` (or ``with`` exit) puts the originals back."""
        return components.replace(self, pattern, impl, **kw)

    def use_kernels(self, pattern="**", enable: bool = True, **kw) -> int:
        """Switch the matching components to their kernel (or back to the reference with
        ``enable=False``); see dsv4lab.analysis.components.use_kernels."""
        return components.use_kernels(self, pattern, enable, **kw)

    def restore(self) -> int:
        """Undo every active component replacement."""
        return components.restore(self)

    # ------------------------------------------------------------ comparisons
    def compare(self, other, ids, **kw):
        """compare_runs(self, other, ids); ``other`` = a model or (model, intervention)."""
        return compare.compare_runs(self, other, ids, **kw)

    def precision_sweep(self, ids, **kw):
        """One component kind at a time to another mode; see dsv4lab.precision.sweep."""
        return sweep.precision_sweep(self, ids, **kw)

    def precision_floor(self, ids, threshold: float, **kw):
        """Greedy: fix the worst kind until the metric meets ``threshold``; see dsv4lab.precision.sweep."""
        return sweep.precision_floor(self, ids, threshold, **kw)

    # ---------------------------------------------------------------- bug zoo
    # ----------------------------------------------------------------- decode
    def decoder(self, state, mode: str = "layer-graphs"):
        """``step(ids, state) -> logits`` over ``state`` by ``mode``: "eager", "graph" (only taps
        follow a replay) or "layer-graphs" (hooked layers eager); see dsv4lab.decode.drivers."""
        return decoder(self, state, mode)

    def generate(self, input_ids, max_new_tokens: int, state=None, decode: str = "eager", **kw):
        """Greedy decoding as :meth:`DSV4Model.generate`, through the decode driver ``decode``
        ("eager", "graph", "layer-graphs"; see :meth:`decoder`)."""
        check_decode_mode(decode)
        if decode == "eager":
            return super().generate(input_ids, max_new_tokens, state=state, **kw)
        if "step_fn" in kw:
            raise ValueError(f"generate: decode={decode!r} and step_fn both pick the decode driver; "
                             "give one (step_fn for a driver of your own)")
        self.check_ids(input_ids)
        check_new_tokens(max_new_tokens)
        B, S = input_ids.shape
        if state is None:
            state = self.new_state(B, S + max_new_tokens)
        check_state(state, B, S + max_new_tokens - 1)   # before a driver is built over it
        return super().generate(input_ids, max_new_tokens, state=state, step_fn=decoder(self, state, decode), **kw)

    def inject(self, bug: str, layers=None, **kw):
        """Inject a known bug variant (dsv4lab.bugzoo.BUGS); returns a restorable handle."""
        return bugzoo.inject(self, bug, layers=layers, **kw)


def as_workbench(model: DSV4Model) -> WorkbenchModel:
    """Give ``model`` the workbench methods in place (its class becomes WorkbenchModel)."""
    if not isinstance(model, DSV4Model):
        raise TypeError(f"as_workbench takes a DSV4Model, got {type(model).__name__}")
    if not isinstance(model, WorkbenchModel):
        model.__class__ = WorkbenchModel
    return model


def random_model(config: DSV4Config, seed: int = 0, dtype=torch.float32, device="cpu") -> WorkbenchModel:
    """A seeded random model (see :func:`dsv4lab.model.init.randomize_`) with the workbench methods."""
    return randomize_(WorkbenchModel(config), seed).to(device, dtype).eval()
