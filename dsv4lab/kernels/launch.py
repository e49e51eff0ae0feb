"""Direct launch of already compiled Triton kernels: ``launch(kernel, grid, *args, **kw)`` does what
``kernel[grid](*args, **kw)`` does, with less host time on a repeat.

Why: eager decode is host-bound. ``JITFunction.run`` spends 17-24 us of host time per launch on the
H200 (Triton 3.6; ``benchmarks/launch_overhead.py``) binding arguments, building its string cache
key, checking globals and building launch metadata, and a V4-Pro decode step makes ~4,900 launches.
Here the first launch of a (kernel, argument layout, keyword values) site goes through ``run``,
which returns the ``CompiledKernel``; its launcher is then called directly
(``compiled.run(gx, gy, gz, stream, function, packed_metadata, None, None, None, *args)``, what
``run`` passes in Triton 3.6 and 3.9, constexprs included: the launcher skips them itself) for
every later call whose key matches.

The key is Triton's own specialisation of each positional argument (``native_specialize_impl``,
the C function ``run``'s binder calls: dtype and 16-byte alignment of tensors, int == 1 / divisible
by 16 / i32-i64-u64, descriptor dtype and block shape), the current device, and the keyword
arguments with their types (constexprs and options such as ``num_warps`` or ``launch_pdl``, by
value). Anything Triton's cache depends on beyond that (debug / instrumentation knobs, stage
hooks, pre-run hooks, launch hooks of a profiler) makes the call take the normal path. So do: the
interpreter (``TRITON_INTERPRET=1``), a kernel that is not a plain ``JITFunction`` (an autotuner, a
test stub), a constexpr or a tensor passed positionally / by keyword in the wrong place, a callable
grid, an unhashable keyword value, a Triton without ``native_specialize_impl``, and
``DSV4LAB_DIRECT_LAUNCH=0`` or ``set_direct_launch(False)``.

Raw launch (Triton 3.6's launcher layout, recognised by its shape; ``DSV4LAB_RAW_LAUNCH=0`` or
``set_raw_launch(False)`` turns it off): ``compiled.run`` is a Python ``CudaLauncher`` whose call
builds two closures and allocates scratch, then a wrapper walks every argument and re-encodes each
TMA descriptor's ``CUtensorMap`` (``make_tensordesc_arg``) before the C launcher runs. A site whose
kernel needs no scratch calls that C launcher itself with the descriptors already expanded; an
expansion is kept on its descriptor and reused while the descriptor's base is the same tensor at the
same address (the weights' descriptors of a plan: every call), so only the activations' descriptors
are encoded per launch. The C launcher copies the 128-byte map into the kernel's parameters by value,
so a kept map is safe in CUDA graphs too. Any other launcher layout keeps ``compiled.run``.

Imports triton: import this module only from kernel modules (``dsv4lab.kernels`` stays triton-free).
"""
from __future__ import annotations

import collections
import inspect
import os
import sys
import weakref
from typing import Any, Callable

import torch
import triton
from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime.jit import JITFunction

from .device import fast_device_getter

try:  # the binder's C specialiser (Triton 3.5+); without it every launch takes the normal path
    from triton._C.libtriton import native_specialize_impl
except ImportError:  # pragma: no cover - older triton
    native_specialize_impl = None

try:
    from triton.knobs import HookChain
except ImportError:  # pragma: no cover - a triton whose launch hooks are plain callables or None
    HookChain = type(None)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
SITES_MAX = 4096    # sites kept before the table is cleared (a caller passing new objects by keyword)
ENTRIES_MAX = 64    # compiled kernels kept per site (specialisation classes x devices)

_SUPPORTED = (native_specialize_impl is not None and not INTERPRET
              and all(hasattr(knobs, k) for k in ("runtime", "compilation"))
              and all(hasattr(knobs.runtime, k) for k in ("launch_enter_hook", "launch_exit_hook", "debug",
                                                          "add_stages_inspection_hook"))
              and hasattr(knobs.compilation, "instrumentation_mode"))
_enabled = _SUPPORTED and os.environ.get("DSV4LAB_DIRECT_LAUNCH", "1") != "0"
_raw_enabled = os.environ.get("DSV4LAB_RAW_LAUNCH", "1") != "0"
_sites: dict = {}  # (id(kernel), n args, keyword names, values, types) -> LaunchSite
_all_sites: "weakref.WeakSet[LaunchSite]" = weakref.WeakSet()  # what clear() resets, plans' sites included
_runtime = knobs.runtime
_compilation = knobs.compilation
stats = {"direct": 0, "normal": 0, "raw": 0}  # launches per path since the last ``clear()`` (raw: direct ones that
                                              # skipped Triton's Python launcher; tests, benchmarks)
# normal-path launches per kernel name since the last ``clear()``: which kernels miss the direct path
# (each such launch costs Triton's Python launcher on the host: what an eager step waits on)
normal_by_kernel: collections.Counter = collections.Counter()


def set_direct_launch(enabled: bool) -> bool:
    """Switch the direct path on or off for this process (off: every launch is ``kernel[grid]``);
    returns the previous setting. It cannot be switched on under the interpreter or without
    ``native_specialize_impl``."""
    global _enabled
    prev = _enabled
    _enabled = bool(enabled) and _SUPPORTED
    return prev


def direct_launch_enabled() -> bool:
    return _enabled


def set_raw_launch(enabled: bool) -> bool:
    """Switch the raw launch (see the module docstring) on or off for this process; returns the
    previous setting. Sites built before keep what they found until ``clear()``."""
    global _raw_enabled
    prev = _raw_enabled
    _raw_enabled = bool(enabled)
    return prev


def clear() -> None:
    """Forget every cached launcher (e.g. after changing Triton knobs by hand) and zero ``stats``."""
    _sites.clear()
    for site in list(_all_sites):
        site.reset()
    stats["direct"] = stats["normal"] = stats["raw"] = 0
    normal_by_kernel.clear()


# hooks that older Tritons kept on CompiledKernel (absent in 3.6 / 3.9: not looked up per launch)
_CLASS_HOOKS = tuple(n for n in ("launch_enter_hook", "launch_exit_hook") if hasattr(CompiledKernel, n))


def _triton_state_plain() -> bool:
    """No launch hook (a profiler's), no compile-affecting knob set: what the direct path assumes on
    every call. Triton 3.6 / 3.9 keep the launch hooks as ``HookChain`` s, idle when empty."""
    rt = _runtime
    e, x = rt.launch_enter_hook, rt.launch_exit_hook
    return ((e is None or (type(e) is HookChain and not e.calls))
            and (x is None or (type(x) is HookChain and not x.calls))
            and not rt.debug and rt.add_stages_inspection_hook is None and not _compilation.instrumentation_mode
            and (not _CLASS_HOOKS or all(getattr(CompiledKernel, n) is None for n in _CLASS_HOOKS)))


class LaunchSite:
    """``kernel[grid](*args, **kw)`` for one call layout: ``kw`` (constexprs, launch options) fixed
    here, the positional arguments given per call. A plan that launches the same kernel on every
    call keeps one (``site(grid, *args)``); ``launch()`` keeps one per layout it meets.

    ``fixed``: positions whose argument is the *same object* on every call (a plan's descriptors and
    ints): their specialisation is taken from the first call and checked by identity (``is``), not
    recomputed; a call passing another object there takes the normal path. Tensors are always
    keyed by dtype and alignment (``t.data = ...`` keeps the object but may move its storage)."""

    __slots__ = ("kernel", "kw", "fixed", "ok", "key", "tail", "stream", "entries", "__weakref__")

    def __init__(self, kernel: Any, fixed: tuple[int, ...] = (), **kw: Any):
        self.kernel, self.kw, self.fixed = kernel, kw, tuple(fixed)
        self.reset()
        _all_sites.add(self)

    def reset(self) -> None:
        """Forget the compiled kernels and the layout (the next call goes through ``kernel[grid]``)."""
        self.ok = True                # False: this layout always takes the normal path
        self.key: Callable | None = None   # args -> the entry key, None when a fixed argument changed
        self.tail: tuple = ()         # values of the parameters after the positional ones
        self.stream: Callable | None = None
        self.entries: dict = {}       # key -> (launcher, function, packed metadata)

    def __call__(self, grid: tuple, *args: Any) -> None:
        key = self.key
        if key is not None and _enabled and type(grid) is tuple and _triton_state_plain():
            try:
                k = key(args)
            except Exception:  # an argument of another type than the first call's and Triton refuses it
                k = None
            ent = self.entries.get(k) if k is not None else None
            if ent is not None:
                n = len(grid)
                if ent[3] is not None:  # Triton's C launcher, descriptors expanded here
                    ent[3](grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, self.stream(k[0]), ent[1],
                           ent[2], args, self.tail)
                    stats["raw"] += 1
                else:
                    ent[0](grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, self.stream(k[0]), ent[1],
                           ent[2], None, None, None, *args, *self.tail)
                stats["direct"] += 1
                return
        self._normal(grid, args)

    def _normal(self, grid: tuple, args: tuple) -> None:
        """``kernel[grid]``, then (when the direct path applies) its compiled kernel under this key."""
        stats["normal"] += 1
        normal_by_kernel[getattr(self.kernel, "__name__", "?")] += 1
        compiled = self.kernel[grid](*args, **self.kw)
        if not (self.ok and _enabled and type(grid) is tuple and _triton_state_plain()):
            return
        if self.key is None:
            self.ok = self._build(args)
            if not self.ok:
                return
        try:
            k = self.key(args)
        except Exception:
            return
        if k is None:
            return
        try:
            ent = (compiled.run, compiled.function, compiled.packed_metadata,
                   raw_caller(compiled.run, len(args) + len(self.tail)) if _raw_enabled else None)
        except Exception:  # e.g. a future of an asynchronous compile, a stand-in driver: stay normal
            return
        if len(self.entries) >= ENTRIES_MAX:
            self.entries.clear()
        self.entries[k] = ent

    def _build(self, args: tuple) -> bool:
        """Check the layout (positional non-constexpr parameters first, then constexprs / scalars by
        keyword or defaults) and generate the key function for it; False if it cannot go direct."""
        kernel, kw = self.kernel, self.kw
        if type(kernel) is not JITFunction or getattr(kernel, "pre_run_hooks", None):
            return False
        params = kernel.params
        n = len(args)
        if n > len(params) or any(i >= n for i in self.fixed):
            return False
        for p in params[:n]:
            if p.is_constexpr or p.name in kw:
                return False
        by_name = {p.name: p for p in params}
        for name, v in kw.items():
            p = by_name.get(name)
            # a non-constexpr parameter by keyword: only a plain scalar, whose value (in the site) fixes it
            if p is not None and not p.is_constexpr and type(v) not in (int, float, bool, type(None)):
                return False
        tail = []
        for p in params[n:]:
            if p.name in kw:
                tail.append(kw[p.name])
            elif p.default is not inspect.Parameter.empty:
                tail.append(p.default)
            else:
                return False
        drv = triton.runtime.driver.active
        device = fast_device_getter(drv.get_current_device)
        caches = kernel.device_caches.get(device())
        if caches is None:
            return False
        env = {"_s": native_specialize_impl, "_b": caches[3], "_T": torch.Tensor, "_d": device}
        guard, exprs = [], []
        for i, (a, p) in enumerate(zip(args, params)):
            flags = (bool(p.is_const), not p.do_not_specialize, not p.do_not_specialize_on_alignment)
            if i in self.fixed and type(a) is not torch.Tensor:
                env[f"_f{i}"] = a
                env[f"_k{i}"] = native_specialize_impl(caches[3], a, *flags)
                guard.append(f"a[{i}] is _f{i}")
                exprs.append(f"_k{i}")
            else:
                exprs.append(_arg_key_expr(f"a[{i}]", a, flags))
        src = (f"def key(a):\n    if len(a) != {n}{''.join(' or not ' + g for g in guard)}:\n        return None\n"
               f"    return (_d(), {', '.join(exprs)})\n")
        exec(src, env)
        self.key, self.tail, self.stream = env["key"], tuple(tail), drv.get_current_stream
        return True


def _closure(fn: Any) -> dict:
    """The free variables of a Python closure by name ({} for anything else)."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or cells is None:
        return {}
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}


def _expanded(d: Any, meta: Any, make: Callable) -> list:
    """``make(d, meta)`` (Triton's ``[CUtensorMap, *shape, *strides]`` of descriptor ``d``), kept on
    ``d`` while its base is the same tensor at the same address."""
    slots = getattr(d, "__dict__", None)
    if slots is None:  # a descriptor class without an instance dict: nothing to keep it in
        return make(d, meta)
    base = d.base
    ptr = base.data_ptr()
    kept = slots.get("_dsv4lab_expanded")
    if kept is not None and kept[0] is base and kept[1] == ptr:
        return kept[2]
    exp = make(d, meta)
    slots["_dsv4lab_expanded"] = (base, ptr, exp)
    return exp


def raw_caller(run: Any, n_args: int) -> Callable | None:
    """``call(gx, gy, gz, stream, function, packed_metadata, args, tail)`` launching through Triton
    3.6's C launcher behind ``run`` (a ``CudaLauncher``), descriptors expanded by ``_expanded``; None
    when ``run`` is not that layout (another Triton, a stand-in, a kernel that needs scratch)."""
    cls = type(run)
    if cls.__name__ != "CudaLauncher" or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    module = sys.modules.get(cls.__module__)
    call_code = getattr(cls.__call__, "__code__", None)
    # 3.6: __call__(self, gridX, gridY, gridZ, stream, function, *args) -> self.launch(grid, stream, function,
    # coop, pdl, global_scratch, profile_scratch, *args) over "iiiKKppOOOOOO" + the kernel's arguments
    if (module is None or getattr(module, "_BASE_ARGS_FORMAT", None) != "iiiKKppOOOOOO" or call_code is None
            or call_code.co_argcount != 6 or not call_code.co_flags & inspect.CO_VARARGS):
        return None
    launch_fn = run.launch
    coop, pdl = bool(run.launch_cooperative_grid), bool(run.launch_pdl)
    env: dict = {"_coop": coop, "_pdl": pdl, "_e": _expanded}
    if inspect.isbuiltin(launch_fn):  # no descriptor arguments: Triton did not wrap it
        env["_L"] = launch_fn
        exprs = [f"a[{i}]" for i in range(n_args)]
    else:
        cl = _closure(launch_fn)
        make = getattr(module, "make_tensordesc_arg", None)
        if (set(cl) != {"launcher", "tensordesc_indices", "tensordesc_meta"} or not callable(cl["launcher"])
                or getattr(make, "__code__", None) is None or make.__code__.co_argcount != 2):
            return None
        indices, metas = sorted(cl["tensordesc_indices"]), list(cl["tensordesc_meta"])
        if len(indices) != len(metas) or any(i >= n_args for i in indices):
            return None
        env.update(_L=cl["launcher"], _make=make)
        exprs = []
        for i in range(n_args):
            if i in indices:
                env[f"_m{i}"] = metas[indices.index(i)]
                exprs.append(f"*_e(a[{i}], _m{i}, _make)")
            else:
                exprs.append(f"a[{i}]")
    # the positional arguments, then the tail (constexprs and defaults, which the launcher skips)
    body = ", ".join(exprs)
    src = (f"def call(gx, gy, gz, s, fn, md, args, tail):\n"
           f"    a = args + tail\n"
           f"    _L(gx, gy, gz, s, fn, _coop, _pdl, None, None, md, None, None, None, {body})\n")
    exec(src, env)
    return env["call"]


def _arg_key_expr(x: str, a: Any, flags: tuple) -> str:
    """Source of the key of argument ``x`` (first seen as ``a``): a fast exact form for the type
    ``a`` has, Triton's specialiser for any other type. The forms cannot equal one another (tensor:
    (torch dtype, aligned); int: 4 bools; float: "f"; None; Triton's: 2-tuples of strings)."""
    nat = f"_s(_b, {x}, {flags[0]}, {flags[1]}, {flags[2]})"
    if type(a) is torch.Tensor:
        return f"(({x}.dtype, {x}.data_ptr() & 15 == 0) if type({x}) is _T else {nat})"
    if type(a) is int:  # Triton: == 1 is a constexpr; divisible by 16; i32 / i64 / u64 by range
        return (f"(({x} == 1, {x} & 15 == 0, -2147483648 <= {x} <= 2147483647, {x} >= 9223372036854775808)"
                f" if type({x}) is int else {nat})")
    if type(a) is float:  # fp32, never specialised on the value
        return f"('f' if type({x}) is float else {nat})"
    if a is None:
        return f"(None if {x} is None else {nat})"
    return nat


def new_site(sites: dict, key: Any, kernel: Any, **kw: Any) -> LaunchSite:
    """A ``LaunchSite(kernel, **kw)`` kept in the caller's ``sites`` under ``key``, which must name
    every value of ``kw`` and the kernel by ``id(kernel)`` (tests replace module attributes; a
    ``JITFunction`` hashes through its ``cache_key`` property under a lock, ~1 us a lookup, and the site
    keeps its kernel alive, so the id cannot be reused while the key is in the table). The call
    site's ``sites.get(key) or new_site(sites, key, ...)`` costs one tuple and one lookup a launch
    (~0.2 us), where ``launch()`` keys every keyword's value and type (~2.5-3.5 us on a slow host core)."""
    if len(sites) >= SITES_MAX:
        sites.clear()
    site = sites[key] = LaunchSite(kernel, **kw)
    return site


def launch(kernel: Any, grid: tuple, *args: Any, **kw: Any) -> None:
    """``kernel[grid](*args, **kw)``, through the ``LaunchSite`` of this (kernel, number of positional
    arguments, keyword values and types). Pass tensors and runtime scalars positionally, constexprs
    and launch options by keyword; other layouts take the normal path."""
    if _enabled:
        try:
            skey = (id(kernel), len(args), tuple(kw), tuple(kw.values()), tuple(map(type, kw.values())))
            site = _sites.get(skey)
            if site is None:
                if len(_sites) >= SITES_MAX:
                    _sites.clear()
                site = _sites[skey] = LaunchSite(kernel, **kw)
        except TypeError:  # an unhashable keyword value
            site = None
        if site is not None:
            site(grid, *args)
            return
    stats["normal"] += 1
    normal_by_kernel[getattr(kernel, "__name__", "?")] += 1
    kernel[grid](*args, **kw)
