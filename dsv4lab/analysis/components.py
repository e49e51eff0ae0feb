"""Swappable components: list them, replace an implementation, restore the original.

A component is any submodule with a stable dotted name (``layers.1.attn.compressor``,
``layers.2.mlp.experts.3``, ``layers.0.attn.wq_a``); hook points and containers are not listed.
Component patterns match per dotted segment: ``*`` matches within ONE segment,
``**`` any number of segments (``layers.*.mlp.experts.*`` = every routed expert, not their
linears; ``**.wq_b`` = every wq_b). A list of patterns or a predicate ``f(name, module)`` also work.

``replace(model, pattern, impl)`` accepts:
  * a module CLASS: built from the original with ``impl.from_original(orig)`` when it defines
    that classmethod, else as a shallow clone that shares the original's parameters, buffers and
    children (hook points included, so hook names are unchanged) -- a subclass overriding one
    method is the usual case (see dsv4lab.bugzoo);
  * a module INSTANCE: used as is (one instance for every match);
  * a CALLABLE with the signature of the replaced method (``forward`` by default; components
    whose entry points are ``prefill``/``decode`` need ``method=`` or a {method: fn} dict).
The returned handle restores the originals (``handle.restore()`` or ``with`` block);
``restore(model)`` undoes every replacement still active, newest first.

``use_kernels(model, pattern, enable)`` switches the kernel implementations (``QLinear.kernel``,
``Experts.kernel``, ``Compressor.kernel`` / ``.decode_kernel``, ``Attention.kernel`` / ``decode_kernel``, ``Indexer.decode_kernel``:
``dsv4lab.kernels``) of the matching components on or off.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import pandas as pd
import torch
from torch import nn

from ..checkpoint.names import layer_of, module_kind
from ..handles import Restorable
from ..kernels.install import install_kernels, kernel_state, restore_kernels  # noqa: F401  (re-exported)
from ..model.component import note_change
from ..model.hooks import HookPoint
from ..model.linear import QLinear
from ..patterns import component_matcher, no_match_error, unmatched

# class name -> component kind (QLinear kinds come from the canonical naming, docs/naming.md)
_KIND_BY_CLASS = {
    "DecoderLayer": "layer", "Attention": "attn", "Indexer": "indexer", "HyperConnection": "mhc",
    "HyperHead": "mhc.head", "MoE": "moe", "Router": "router", "Experts": "experts", "Expert": "expert",
    "SharedExpert": "shared_expert", "RMSNorm": "norm", "Embedding": "embed", "Rotary": "rope",
}


def no_component_error(model, pattern) -> KeyError:
    """The error for a component pattern that matches nothing, with did-you-mean."""
    names = [n for n, _ in iter_components(model)]
    pats = unmatched(pattern, names) or [str(pattern)]
    return no_match_error("component", "pattern", pats[0], names, "see model.components()")


def _base_class(mod: nn.Module) -> type:
    """The reference class a (possibly replaced) module stands for."""
    return getattr(type(mod), "_reference_class", None) or type(mod)


def kind_of(name: str, mod: nn.Module) -> str:
    cls = _base_class(mod)
    for klass in cls.__mro__:
        if klass.__name__ == "Compressor":
            return "indexer.compressor" if ".indexer." in f".{name}." else "compressor"
        if klass.__name__ in _KIND_BY_CLASS:
            return _KIND_BY_CLASS[klass.__name__]
        if klass is QLinear:
            try:
                return module_kind(name)
            except KeyError:
                return "linear"
    return cls.__name__.lower()


def impl_label(mod: nn.Module) -> str:
    lab = getattr(mod, "_impl_label", None)
    if lab:
        return lab
    # the main slots (Attention: "kernel:prefill_attention+decode_attention"), else another installed
    # ``*_kernel`` slot (a Router on a plain gate: route_kernel; a plain QLinear: plain_kernel)
    fns = [fn for fn in (getattr(mod, "kernel", None), getattr(mod, "decode_kernel", None)) if fn is not None]
    if not fns:
        slots = sorted((k == "plain_kernel", k) for k, v in vars(mod).items() if k.endswith("_kernel") and v is not None)
        fns = [getattr(mod, k) for _, k in slots[:1]]
    if fns:  # Attention, Compressor: prefill and decode kernels; glue-only slots: the first
        return "kernel:" + "+".join(getattr(fn, "__name__", type(fn).__name__) for fn in fns)
    return "reference"


def iter_components(model, pattern=None):
    match = component_matcher(pattern) if pattern is not None else None
    for name, mod in model.named_modules():
        if not name or isinstance(mod, (HookPoint, nn.ModuleList)):
            continue
        if match is None or match(name, mod):
            yield name, mod


def components(model, pattern=None):
    """DataFrame: name, kind, class, impl, layer (and mode/format for linears)."""
    rows = []
    for name, mod in iter_components(model, pattern):
        rows.append({"name": name, "kind": kind_of(name, mod), "class": type(mod).__name__,
                     "impl": impl_label(mod), "layer": layer_of(name),
                     "mode": getattr(mod, "mode", None), "format": getattr(mod, "format", None)})
    df = pd.DataFrame(rows, columns=["name", "kind", "class", "impl", "layer", "mode", "format"])
    df["layer"] = df["layer"].astype("Int64")
    return df


# ------------------------------------------------------------------------------ building impls
def shallow_clone(orig: nn.Module, cls: type) -> nn.Module:
    """A ``cls`` instance sharing ``orig``'s parameters, buffers and children (no copy)."""
    new = cls.__new__(cls)
    d = dict(orig.__dict__)
    for key in ("_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks",
                "_non_persistent_buffers_set"):
        if key in d:
            d[key] = copy.copy(d[key])
    new.__dict__.update(d)
    setup = getattr(new, "_setup_from_original", None)
    if setup is not None:
        setup(orig)
    return new


COPY_LIMIT_BYTES = 1 << 30  # share=False copies at most this much of one component's state


def state_bytes(mod: nn.Module) -> int:
    """Bytes a deep copy of ``mod`` duplicates: its parameters, buffers and the quantised weights of
    its linears (``QLinear.qweight`` is no parameter: NVFP4 layers hold their weights there), each
    storage counted once (tied weights, views)."""
    tensors = [*mod.parameters(), *mod.buffers()]
    for m in mod.modules():
        if isinstance(m, QLinear) and m.qweight is not None:
            tensors += [t for t in m.qweight.tensors().values() if isinstance(t, torch.Tensor)]
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr() if st.device.type != "meta" else id(st)] = st.nbytes()
    return sum(seen.values())


def _from_class(name: str, orig: nn.Module, cls: type, share: bool) -> nn.Module:
    if hasattr(cls, "from_original"):
        return cls.from_original(orig)
    if share:
        return shallow_clone(orig, cls)
    size = state_bytes(orig)
    if size > COPY_LIMIT_BYTES:  # a V4-Pro decoder layer is ~14 GB: a copy beside it does not fit the GPU
        raise ValueError(f"replace(share=False) would copy {size / 1e9:.2f} GB of {name!r}'s weights "
                         f"(limit {COPY_LIMIT_BYTES / 1e9:.2f} GB, analysis.components.COPY_LIMIT_BYTES): "
                         f"use share=True (no copy), or give {cls.__name__} a from_original that copies "
                         f"only the tensors it changes, or target a smaller component")
    return shallow_clone(copy.deepcopy(orig), cls)


def _callable_class(orig: nn.Module, fns: dict[str, Callable], pass_module: bool) -> type:
    base = type(orig)
    ns = {"_reference_class": _base_class(orig)}
    for meth, fn in fns.items():
        if not callable(getattr(base, meth, None)):
            raise AttributeError(f"{base.__name__} has no method {meth!r} to replace")

        def make(fn=fn):
            if pass_module:
                return lambda self, *a, **k: fn(self, *a, **k)
            return lambda self, *a, **k: fn(*a, **k)

        ns[meth] = make()
    return type(f"Callable{base.__name__}", (base,), ns)


def _default_method(orig: nn.Module) -> str:
    if type(orig).forward is not nn.Module.forward:
        return "forward"
    raise TypeError(f"{type(orig).__name__} has no forward (entry points like prefill/decode): pass "
                    f"method='prefill' or a {{method: fn}} dict")


def _label(impl, method) -> str:
    if isinstance(impl, type):
        return getattr(impl, "impl_label", None) or impl.__name__
    if isinstance(impl, nn.Module):
        return f"instance:{type(impl).__name__}"
    if isinstance(impl, dict):
        return "callable:" + ",".join(f"{m}={getattr(f, '__name__', 'fn')}" for m, f in impl.items())
    return f"callable:{getattr(impl, '__name__', type(impl).__name__)}"


# ------------------------------------------------------------------------------ handles
@dataclass
class ReplaceHandle(Restorable):
    """Replacements made by one :func:`replace` call; ``restore()`` puts the originals back."""

    model: object
    entries: list = field(default_factory=list)  # (name, parent, child_key, orig, new)
    label: str = ""
    active: bool = True

    @property
    def names(self) -> list[str]:
        return [e[0] for e in self.entries]

    @property
    def modules(self) -> dict[str, nn.Module]:
        return {e[0]: e[4] for e in self.entries}

    def restore(self) -> None:
        if not self.active:
            return
        for name, parent, key, orig, new in reversed(self.entries):
            parent._modules[key] = orig
        note_change()  # writes to _modules bypass Component.__setattr__: count the swap back
        self.active = False
        stack = getattr(self.model, "_replace_stack", None)
        if stack is not None and self in stack:
            stack.remove(self)

    def __repr__(self) -> str:
        return f"ReplaceHandle({self.label!r}, {len(self.entries)} modules, active={self.active})"


def _parent_of(model, name: str):
    parent_name, _, key = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), key


def replace(model, pattern, impl, *, method: str | None = None, label: str | None = None, share: bool = True,
            pass_module: bool = False, strict: bool = True, kind: str | None = None) -> ReplaceHandle:
    """Replace every component matching ``pattern`` (outermost matches only) with ``impl``.

    ``kind`` optionally restricts matches to one component kind (``kind_of``). ``share=False``
    deep-copies the original's state before building a class impl (refused above
    ``COPY_LIMIT_BYTES``: no flow copies a full-scale layer). ``pass_module=True`` calls a
    callable impl as ``fn(module, *args)`` (the module is the clone standing in for the original).
    """
    match = component_matcher(pattern)
    targets = []
    for name, mod in iter_components(model):
        if any(name.startswith(t + ".") for t, _ in targets):
            continue  # inside a component already being replaced
        if match(name, mod) and (kind is None or kind_of(name, mod) == kind):
            targets.append((name, mod))
    if not targets and strict:
        raise no_component_error(model, pattern)
    handle = ReplaceHandle(model, label=label or _label(impl, method))
    try:
        for name, orig in targets:
            if isinstance(impl, type) and issubclass(impl, nn.Module):
                new = _from_class(name, orig, impl, share)
            elif isinstance(impl, nn.Module):
                new = impl
            elif isinstance(impl, dict) or callable(impl):
                fns = impl if isinstance(impl, dict) else {method or _default_method(orig): impl}
                new = shallow_clone(orig, _callable_class(orig, fns, pass_module))
            else:
                raise TypeError(f"cannot use {type(impl).__name__} as a component implementation")
            try:
                new._impl_label = handle.label
            except Exception:
                pass
            parent, key = _parent_of(model, name)
            parent._modules[key] = new
            note_change()  # a swap: graph decode recaptures, host-side caches (Experts.stack) decide again
            handle.entries.append((name, parent, key, orig, new))
    except Exception:
        handle.restore()
        raise
    if not hasattr(model, "_replace_stack"):
        model.__dict__["_replace_stack"] = []
    model._replace_stack.append(handle)
    return handle


# ------------------------------------------------------------------------------ kernels
def use_kernels(model, pattern="**", enable: bool = True, *, linear: Callable | None = None,
                experts: Callable | None = None, strict: bool = True) -> int:
    """Install (``enable=True``) or remove (``False``) the kernels of the components matching
    ``pattern``; ``dsv4lab.kernels.install.install_kernels`` decides which component gets which
    (strict by default here: KeyError when nothing matches). ``components()`` shows them in
    ``impl`` (``kernel:<fn>``)."""
    return install_kernels(model, pattern, enable, strict=strict, linear=linear, experts=experts)


def restore(model) -> int:
    """Undo every active replacement (newest first); returns how many handles were restored."""
    stack = list(getattr(model, "_replace_stack", []))
    for h in reversed(stack):
        h.restore()
    return len(stack)


def owner_of(model, name: str) -> str:
    """The nearest enclosing component (itself included) that holds hook points: where a change
    made inside ``name`` first becomes visible (``layers.0.attn.wq_a`` -> ``layers.0.attn``)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        cand = ".".join(parts[:i])
        try:
            mod = model.get_submodule(cand)
        except AttributeError:
            continue
        if any(isinstance(m, HookPoint) for m in mod.modules()):
            return cand
    return name  # a top-level module without hook points (e.g. ``head``): its output shows at root hooks


def hook_inside(model, hook_name: str, component: str) -> bool:
    """Does hook ``hook_name`` observe component ``component`` from inside (or, for a top-level
    component without hook points such as ``head``, right after it at a root-level hook)?"""
    owner = owner_of(model, component)
    if hook_name.startswith(owner + "."):
        return True
    if "." not in hook_name and "." not in owner:
        mod = model.get_submodule(owner)
        return not any(isinstance(m, HookPoint) for m in mod.modules())
    return False


