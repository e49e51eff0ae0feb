"""A DSV4 model over several devices: device maps, moving a model, gathering results to one device.

The model itself moves hidden streams between devices at layer boundaries (``DSV4Model.prefill``
and ``decode_segments``: one contiguous run of layers per device); the loader places each tensor
on its layer's device (``dsv4lab.load(path, device_map=...)``). This module adds:

* :func:`normalize_device_map`: list / dict / :class:`~dsv4lab.plan.MemoryPlan` / one device ->
  one ``torch.device`` per layer, refusing maps whose devices are not contiguous runs (a device
  that comes back after another would have its decode position advanced twice per step);
* :func:`dispatch`: place an in-memory model (e.g. ``random_model``) by a device map; embed with
  layer 0, ``hc_head``/``norm``/``head`` with the last layer (as the loader does);
* :func:`model_devices`, :func:`segments`: where everything is;
* :func:`gather_to`: tensors, QuantWeights, nested containers, a :class:`DecodeState` or an
  :class:`~dsv4lab.analysis.cache.ActivationCache` copied to one chosen device (for comparisons:
  ``compare_runs``/``run_with_cache`` already offload captures to their ``device=``).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from .analysis.cache import ActivationCache
from .model.state import CompressorState, DecodeState, LayerState
from .model.validate import DEVICE_FORMS, as_device
from .quant.weights import QuantWeight

_MAP_FORMS = f"{DEVICE_FORMS}, or a device map: one device per layer"


def normalize_device_map(device_map: Any, n_layers: int, check_contiguous: bool = True) -> list[torch.device]:
    """One ``torch.device`` per layer from a list, a ``{layer: device}`` dict, a MemoryPlan or one device."""
    if hasattr(device_map, "device_map") and callable(device_map.device_map):  # MemoryPlan
        device_map = device_map.device_map()
    if isinstance(device_map, (str, torch.device, int)):
        devs = [as_device(device_map, forms=_MAP_FORMS)] * n_layers
    elif isinstance(device_map, Mapping):
        missing = [i for i in range(n_layers) if i not in device_map]
        if missing:
            raise ValueError(f"device_map has no device for layers {missing[:8]}{'...' if len(missing) > 8 else ''}")
        extra = sorted(k for k in device_map if not (isinstance(k, int) and 0 <= k < n_layers))
        if extra:
            raise ValueError(f"device_map has entries {extra[:8]} outside layers 0..{n_layers - 1}")
        devs = [as_device(device_map[i], f"device_map[{i}]") for i in range(n_layers)]
    else:
        devs = [as_device(d, f"device_map[{i}]") for i, d in enumerate(device_map)]
        if len(devs) != n_layers:
            raise ValueError(f"device_map has {len(devs)} entries for {n_layers} layers")
    if check_contiguous:
        seen: set = set()
        for i, d in enumerate(devs):
            if i and d != devs[i - 1] and d in seen:
                raise ValueError(f"device_map is not contiguous: layer {i} goes back to {d} after "
                                 f"{devs[i - 1]}; each device must hold one run of consecutive layers")
            seen.add(d)
    return devs


def _move_module(mod: nn.Module, device: torch.device) -> None:
    params = list(mod.parameters()) + list(mod.buffers())
    if any(p.is_meta for p in params) and device.type != "meta":
        mod.to_empty(device=device)  # meta holds no values: storage only (fill it before use)
    else:
        mod.to(device)


def dispatch(model: nn.Module, device_map: Any) -> nn.Module:
    """Move an in-memory DSV4Model so layer i lives on ``device_map[i]`` (in place; returns it).

    Embedding goes with layer 0, ``hc_head``/``norm``/``head`` with the last layer. Moving off the
    meta device allocates uninitialised storage (``to_empty``): only for placement checks.
    """
    n = len(model.layers)
    devs = normalize_device_map(device_map, n)
    _move_module(model.embed, devs[0])
    for layer, d in zip(model.layers, devs):
        _move_module(layer, d)
    for name in ("hc_head", "norm", "head"):
        _move_module(getattr(model, name), devs[-1])
    return model


def model_devices(model: nn.Module) -> dict[str, Any]:
    """``{"embed": device, "layers": [device per layer], "head": device}``."""
    return {"embed": model.embed.weight.device, "layers": list(model.layer_devices()), "head": model.head_device()}


def segments(model: nn.Module) -> list[tuple[torch.device, int, int]]:
    """``(device, first layer, last layer)`` per contiguous run (what ``decode_segments`` gives)."""
    return [(d, r.start, r.stop - 1) for d, r in model.decode_segments()]


def gather_to(obj: Any, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> Any:
    """A copy of ``obj`` with every tensor on ``device`` (floating tensors cast to ``dtype`` if given).

    Handles tensors, QuantWeights, dicts / lists / tuples, :class:`DecodeState` (its per-device
    position counters collapse to one on ``device``) and :class:`ActivationCache`.
    """
    dev = torch.device(device)

    def g(x):
        if isinstance(x, torch.Tensor):
            y = x.detach().to(dev)
            if dtype is not None and y.is_floating_point():
                y = y.to(dtype)
            return y
        if isinstance(x, QuantWeight):
            return x.to(dev)
        if isinstance(x, Mapping):
            return type(x)((k, g(v)) for k, v in x.items()) if isinstance(x, dict) else {k: g(v) for k, v in x.items()}
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(g(v) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(g(v) for v in x)
        return x

    if isinstance(obj, DecodeState):
        def cs(c):
            return None if c is None else CompressorState(g(c.ring_kv), g(c.ring_gate), g(c.entries))

        layers = [LayerState(g(ls.kv_ring), cs(ls.compressor), cs(ls.indexer)) for ls in obj.layers]
        pos_t = obj.pos_t.detach().to(dev).clone()
        extra = {k: v for k, v in obj.extra.items() if k != "pos_by_device"}
        extra["pos_by_device"] = {dev: pos_t}
        return DecodeState(layers, pos_t, obj.pos, obj.max_len, obj.batch, extra)
    if isinstance(obj, ActivationCache):
        out = ActivationCache()
        out._store = {k: [g(v) for v in vs] for k, vs in obj._store.items()}
        out.order = list(obj.order)
        out.skipped = list(obj.skipped)
        out.reduced = dict(obj.reduced)
        out.nbytes = obj.nbytes
        out.steps = list(obj.steps)
        return out
    return g(obj)


def devices_of(obj: Any) -> set[torch.device]:
    """Every device a tensor inside ``obj`` (as :func:`gather_to` walks it) lives on."""
    out: set[torch.device] = set()

    def walk(x):
        if isinstance(x, torch.Tensor):
            out.add(x.device)
        elif isinstance(x, Mapping):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    if isinstance(obj, DecodeState):
        walk(obj.tensors())
    elif isinstance(obj, ActivationCache):
        walk(obj._store)
    else:
        walk(obj)
    return out


__all__ = ["normalize_device_map", "dispatch", "model_devices", "segments", "gather_to", "devices_of"]
