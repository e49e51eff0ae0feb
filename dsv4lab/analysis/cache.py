"""Run with cache: capture hook-point activations (filtered, reduced on device, offloaded,
memory-bounded) without changing the computation (logits are bitwise equal with and without).

    logits, cache = model.run_with_cache(ids, names=["layers.*.hook_resid_post", "**.router.hook_ids"],
                                         reduce={"**.hook_probs": topk(4)}, device="cpu")
    cache["layers.2.hook_resid_post"]             # last firing
    cache.all("layers.2.mlp.router.hook_ids")     # one entry per firing (prefill + decode steps)
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Callable

import torch

from ..checkpoint.errors import DeviceUnavailableError
from ..model.validate import DEVICE_FORMS, InputError, as_device, check_int
from ..patterns import close_names, matches
from ..quant.modes import unknown_choice
from .hooks import check_hook_names, hooks, name_filter


# ---------------------------------------------------------------- reductions (run on the device)
def topk(k: int, dim: int = -1, largest: bool = True) -> Callable:
    """Keep the top-k values and their indices along ``dim`` -> {"values", "indices"}."""
    def f(t):
        t2 = t.float() if t.is_floating_point() else t
        r = t2.topk(min(k, t.shape[dim]), dim=dim, largest=largest)
        return {"values": r.values, "indices": r.indices}

    f.__name__ = f"topk{k}"
    return f


def norm(dim: int = -1, p: float = 2.0) -> Callable:
    """Vector norm along ``dim`` (fp32)."""
    def f(t):
        return torch.linalg.vector_norm(t.float(), ord=p, dim=dim)

    f.__name__ = f"norm{dim}"
    return f


def histogram(bins: int = 64, range: tuple[float, float] | None = None) -> Callable:
    """Histogram of all finite values -> {"counts", "edges"} (fp32, on the device)."""
    def f(t):
        x = t.detach().float().flatten()
        x = x[torch.isfinite(x)]
        lo, hi = range if range is not None else ((x.min().item(), x.max().item()) if x.numel() else (0.0, 1.0))
        if hi <= lo:
            hi = lo + 1.0
        counts = torch.histc(x, bins=bins, min=lo, max=hi)
        return {"counts": counts, "edges": torch.linspace(lo, hi, bins + 1, device=t.device)}

    f.__name__ = f"hist{bins}"
    return f


def mean(dim=None) -> Callable:
    def f(t):
        t = t.float()
        return t.mean() if dim is None else t.mean(dim=dim)

    f.__name__ = "mean"
    return f


def stats() -> Callable:
    """Scalar summary: mean, std, absmax, rms, fraction non-finite."""
    def f(t):
        x = t.detach().float()
        fin = torch.isfinite(x)
        xf = torch.where(fin, x, torch.zeros_like(x))
        return {"mean": xf.mean(), "std": xf.std() if x.numel() > 1 else xf.new_zeros(()),
                "absmax": xf.abs().amax(), "rms": xf.pow(2).mean().sqrt(), "nonfinite": (~fin).float().mean()}

    f.__name__ = "stats"
    return f


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def _move(obj, device, clone: bool):
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if device is not None and t.device != torch.device(device):
            return t.to(device)
        return t.clone() if clone else t
    if isinstance(obj, Mapping):
        return {k: _move(v, device, clone) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_move(v, device, clone) for v in obj)
    return obj


class ActivationCache(Mapping):
    """name -> captured value (the LAST firing); ``all(name)`` gives every kept firing in order.

    ``order`` lists the captured hook names in firing order (one entry per firing, kept within
    ``max_bytes`` or not; repeats for decode steps); ``skipped`` names what ``max_bytes`` kept out; ``reduced`` maps a name to the
    reduction applied to it.
    """

    def __init__(self) -> None:
        self._store: dict[str, list] = {}
        self.order: list[str] = []
        self.skipped: list[str] = []
        self.reduced: dict[str, str] = {}
        self.nbytes = 0
        self.steps: list[int] = []  # firing index -> generation step (0 = prompt prefill)

    def __getitem__(self, name):
        if name not in self._store:
            raise KeyError(f"{name!r} not cached (cached: {len(self._store)} names; see .keys())")
        return self._store[name][-1]

    def __iter__(self):
        return iter(self._store)

    def __len__(self) -> int:
        return len(self._store)

    def all(self, name: str) -> list:
        return list(self._store[name])

    def filter(self, pattern) -> dict:
        keep = name_filter(pattern)
        return {k: self[k] for k in self._store if keep(k)}

    def stack(self, name: str, dim: int = 0) -> torch.Tensor:
        """Concatenate the kept firings of one (tensor) hook along ``dim`` (e.g. decode steps)."""
        return torch.cat(self.all(name), dim=dim)

    def _add(self, name: str, value, keep: str) -> None:
        if keep == "last" and name in self._store:
            self.nbytes -= _nbytes(self._store[name][-1])
            self._store[name] = [value]
        else:
            self._store.setdefault(name, []).append(value)
        self.nbytes += _nbytes(value)

    def summary(self) -> str:
        return f"ActivationCache({len(self)} names, {self.nbytes / 2**20:.2f} MiB, {len(self.skipped)} skipped)"

    __repr__ = summary


def _reducer_for(reduce, name):
    if not reduce:
        return None
    if callable(reduce):
        return reduce
    for pat, fn in reduce.items():
        if matches(pat, name):
            return fn
    return None


def caching_hook(cache: ActivationCache, names=None, device="cpu", reduce=None, max_bytes: int | None = None,
                 keep: str = "all", clone: bool = True, on_overflow: str = "skip"):
    """The (pattern, fn) pair that fills ``cache``; fn returns None so nothing downstream changes.
    It listens only at ``names``: a listening hook point switches its component to the reference
    (docs/hooks.md "Hooks and kernels"), so capturing the residual streams must not take the other
    components' kernels off."""

    def fn(t, name):
        cache.order.append(name)
        red = _reducer_for(reduce, name)
        with torch.no_grad():
            val = red(t) if red is not None else t
            if red is not None:
                cache.reduced[name] = getattr(red, "__name__", "reduce")
            size = _nbytes(val)
            old = _nbytes(cache._store[name][-1]) if (keep == "last" and name in cache._store) else 0
            if max_bytes is not None and cache.nbytes - old + size > max_bytes:
                if on_overflow == "raise":
                    raise MemoryError(f"activation cache over max_bytes={max_bytes} at {name} ({size} bytes)")
                if name not in cache.skipped:
                    cache.skipped.append(name)
                return None
            cache._add(name, _move(val, device, clone), keep)
        return None

    return ("**" if names is None else names, fn)


KEEPS = ("all", "last")            # run_with_cache(keep=...): every firing, or the last one per hook
ON_OVERFLOW = ("skip", "raise")   # run_with_cache(on_overflow=...) past max_bytes
REDUCER_NAMES = ("topk", "norm", "histogram", "mean", "stats")   # this module's reducer factories


def _check_reduce(reduce) -> None:
    """None, one function of the tensor, or {pattern: function}; else one error naming the argument
    (a reducer's name given as a string: did you mean its factory?)."""
    if reduce is None or callable(reduce):
        return
    if isinstance(reduce, Mapping):
        bad = {k: v for k, v in reduce.items() if not callable(v)}
        if not bad:
            return
        pat, value = next(iter(bad.items()))
        what = f"reduce[{pat!r}]={value!r}"
    else:
        value, what = reduce, f"reduce={reduce!r}"
    near = close_names(str(value), REDUCER_NAMES) if isinstance(value, str) else []
    hint = f"; did you mean {' or '.join(f'cache.{n}(...)' for n in near)}?" if near else ""
    raise InputError(f"{what} is not a function of the captured tensor{hint} (reduce takes a function, "
                     f"e.g. dsv4lab.analysis.cache.{' / '.join(f'{n}()' for n in REDUCER_NAMES)}, a "
                     f"{{pattern: function}} dict, or None)")


def _check_capture_device(device) -> None:
    """Where captures go: None (where computed) or a device this machine has."""
    if device is None:
        return
    d = as_device(device, forms=f"{DEVICE_FORMS}, or None to keep each capture where it was computed")
    if d.type == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailableError(f"device={device!r}: CUDA is not available on this machine (use 'cpu' or None)")


@torch.no_grad()
def run_with_cache(model, ids: torch.Tensor, names=None, device="cpu", reduce=None, max_bytes: int | None = None,
                   generate: int = 0, keep: str = "all", fwd_hooks=(), on_overflow: str = "skip", **gen_kwargs):
    """Run ``model`` on ``ids`` and capture hook activations.

    names: pattern(s) (:mod:`dsv4lab.patterns`) or predicate (None = every hook point; a pattern
    matching no hook point raises KeyError with did-you-mean). device: ``"cpu"`` offloads
    each capture as it is made, ``None`` keeps it where it was computed. reduce: {pattern: fn}
    (or one fn for all) applied on the device before offloading (see :func:`topk`, :func:`norm`,
    :func:`histogram`, :func:`stats`). max_bytes: captures that would exceed it are skipped
    (listed in ``cache.skipped``; ``on_overflow="raise"`` raises instead). generate: number of
    new tokens -> runs ``model.generate`` and returns (tokens, cache); ``keep="last"`` keeps only
    the last firing of every hook (the last decode step), ``"all"`` one entry per step.
    fwd_hooks: interventions active during the run (after capture hooks are attached, so the
    cache shows what each hook point saw before the intervention at that same point).
    Returns (logits, cache) or (tokens, cache).
    """
    check_hook_names(model, names)
    _check_reduce(reduce)
    if isinstance(reduce, Mapping):
        check_hook_names(model, list(reduce), "reduce")
    _check_capture_device(device)
    if keep not in KEEPS:
        raise unknown_choice("keep (argument keep)", keep, KEEPS)
    if on_overflow not in ON_OVERFLOW:
        raise unknown_choice("on_overflow (argument on_overflow)", on_overflow, ON_OVERFLOW)
    check_int(generate, "generate", 0, "new tokens; 0: one forward")
    cache = ActivationCache()
    cap = caching_hook(cache, names, device, reduce, max_bytes, keep, on_overflow=on_overflow)
    with hooks(model, [cap] + list(fwd_hooks)):
        if generate:
            out = model.generate(ids, generate, **gen_kwargs)
        else:
            out = model(ids)
    if cache.skipped:
        warnings.warn(f"run_with_cache: max_bytes={max_bytes} reached, skipped {len(cache.skipped)} names "
                      f"(first: {cache.skipped[0]})", stacklevel=2)
    return out, cache
