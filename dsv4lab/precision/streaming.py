"""Streamed precision: a ``bf16`` / ``orig`` run that never holds more than one dense weight.

:func:`apply_precision` gives every ``bf16`` / ``orig`` linear a dense weight for as long as the
policy is on (a dequantised cache, or the original weight swapped in): on V4-Pro that is ~3 TB
of BF16 next to the 888 GB model, so a reference run in ``bf16`` or ``orig`` cannot run there.
Under :func:`streaming_precision` each such linear (only quantised ones: a plain weight already
is dense) gets a ``weight_source`` (dsv4lab.model.linear.QLinear): ``dense_weight`` asks it for
the dense weight of THIS call -- dequantised from the linear's own FP4 weight for ``bf16``, read
from the ``originals`` source onto the linear's device for ``orig`` -- and nothing keeps it, so
it is freed when the call returns. Every path reaches ``dense_weight``: ``forward``, the grouped
output projection (``wo_a.grouped``), the router (it IS a QLinear), shared and routed experts.

The values are bit-for-bit those of the non-streamed run: the same dequantisation or the same
``originals.weight_on(...).to(model dtype)`` chain, computed again at each call instead of once.

Peak extra memory: the largest streamed linear's dense weight plus a bounded transient. ``bf16``
dequantises by blocks of :data:`STREAM_ROWS` rows into the output (the full-matrix dequant builds
codes and fp32 temporaries: measured peak 9.3x the BF16 size, 2083 MiB for a 224 MiB weight;
by rows 298 MiB); ``orig`` costs what the source's ``weight_on`` costs for one linear. V4-Pro:
lm_head 129280 x 7168 BF16 = 1.85 GB (+ ~0.1 GB for one block).

A linear whose ``dense_weight`` is replaced (a bug-zoo variant such as ``weight_scale_2_dropped``)
computes its own weight: under ``bf16`` it does so per call in both paths; under ``orig`` it is
swapped for real, as ``apply_precision`` does (one dense weight held per such linear).

Routed experts: the graph-safe decode path gathers experts from the stacked FP4 weights
(``Experts.stack``), bypassing ``dense_weight``; under streaming every affected ``Experts``
takes the per-expert masked loop instead (``gather_in_decode`` off, fused kernel off; restored on
exit). Eager prefill (what a reference run is) visits the hit experts one by one anyway. The
streamed run is for eager forwards: ``orig`` reads the disk inside the call, which a CUDA graph
cannot replay.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from ..model.chunking import free_bytes
from ..model.linear import QLinear
from ..model.moe import Experts
from ..quant.modes import Mode
from ..quant.weights import FP8BlockWeight, MXFP4Weight, NVFP4Weight, QuantWeight
from .apply import (
    ModelTargets,
    NoOriginals,
    Originals,
    apply_precision,
    check_targets,
    displaced,
    precision_state,
    restore_precision,
    using_precision,
)
from .policy import PrecisionPolicy, Rule

STREAM_ROWS = 1024      # rows dequantised at once (a multiple of the FP8 block, 128)
DENSE_MODES = (Mode.BF16, Mode.ORIG)
FREE_FRACTION = 0.5     # "auto" streams when the dense weights need more than this share of free memory


# ---------------------------------------------------------------------------- dense weights
def _rows(qw: QuantWeight, r0: int, r1: int) -> QuantWeight | None:
    """Rows ``r0:r1`` of a quantised weight as views (None: this format does not slice there)."""
    if isinstance(qw, NVFP4Weight):
        return NVFP4Weight(qw.packed[r0:r1], qw.block_scale[r0:r1], qw.global_scale, qw.input_scale)
    if isinstance(qw, MXFP4Weight):
        return MXFP4Weight(qw.packed[r0:r1], qw.scale[r0:r1])
    if isinstance(qw, FP8BlockWeight) and r0 % qw.block == 0 and ((r1 - r0) % qw.block == 0 or r1 == qw.shape[0]):
        return FP8BlockWeight(qw.data[r0:r1], qw.scale[r0 // qw.block:-(-r1 // qw.block)], qw.block)
    return None


def dequantize_rows(qw: QuantWeight, dtype: torch.dtype, rows: int = STREAM_ROWS) -> torch.Tensor:
    """``qw.dequantize(dtype)``, bit for bit, built ``rows`` rows at a time into the output: the
    transient is one block's codes and fp32 values, not the whole matrix's."""
    out_f = qw.shape[0]
    if out_f <= rows or _rows(qw, 0, rows) is None:
        return qw.dequantize(dtype)
    out = torch.empty(tuple(qw.shape), dtype=dtype, device=qw.device)
    for r0 in range(0, out_f, rows):
        r1 = min(out_f, r0 + rows)
        out[r0:r1] = _rows(qw, r0, r1).dequantize(dtype)
    return out


def _not_capturing() -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a streamed precision run cannot be captured in a CUDA graph (each call builds its "
                           "weight anew): capture under using_precision, or run eagerly")


def _bf16_source(ql) -> Callable[[torch.dtype], torch.Tensor]:
    qw = ql.qweight

    def dense(dtype: torch.dtype) -> torch.Tensor:
        _not_capturing()
        return dequantize_rows(qw, dtype)

    return dense


def _orig_source(name: str, ql, originals: Originals,
                 model_dtype: torch.dtype) -> Callable[[torch.dtype], torch.Tensor]:
    device = ql.qweight.device

    def dense(dtype: torch.dtype) -> torch.Tensor:
        # the chain apply_precision runs once for an ``orig`` swap, then dense_weight's cast
        _not_capturing()
        w = originals.weight_on(name, device).to(device=device, dtype=model_dtype)
        return w if w.dtype == dtype else w.to(dtype)

    return dense


def _without_orig(policy: PrecisionPolicy, swap: dict) -> PrecisionPolicy:
    """The same policy with ``orig`` read as ``bf16`` (the modes apply_precision sets while the
    weights themselves stream: no swap, no cache), except for the linears in ``swap`` (name ->
    act scale), which keep a real ``orig`` swap."""
    def m(mode):
        return Mode.BF16 if mode == Mode.ORIG else mode

    rules = [Rule(r.target, m(r.mode), r.layers, r.act_scale) for r in policy.rules]
    rules += [Rule(name, Mode.ORIG, None, act) for name, act in swap.items()]
    return PrecisionPolicy(m(policy.default), rules, policy.act_scale, dict(policy.round_trips))


def _replaced(ql) -> bool:
    """A linear whose ``dense_weight`` is overridden (a bug-zoo variant) computes its own weight
    and may ignore a source: its ``bf16`` runs that code per call in either path, and its
    ``orig`` keeps the real swap (one dense weight held per such linear)."""
    return type(ql).dense_weight is not QLinear.dense_weight


def _dense_linears(model, policy: PrecisionPolicy, targets: ModelTargets | None = None) -> list[tuple[str, object, Mode]]:
    aside = displaced(model)
    out = []
    for name, ql in (ModelTargets.of(model) if targets is None else targets).linears:
        mode = policy.mode_for(name)[0]
        if mode in DENSE_MODES and (ql.quantized or name in aside):
            out.append((name, ql, mode))
    return out


def streamed_linears(model, policy, targets: ModelTargets | None = None) -> list[tuple[str, object, Mode]]:
    """(name, linear, mode) of the quantised linears whose mode under ``policy`` is ``bf16`` /
    ``orig`` and whose weight streams (all but the replaced ones, see ``_replaced``)."""
    return [t for t in _dense_linears(model, PrecisionPolicy.parse(policy), targets) if not _replaced(t[1])]


def dense_bytes(model, policy) -> dict[torch.device, int]:
    """Per device: the dense weight bytes the NON-streamed run of ``policy`` would add (each
    ``bf16`` / ``orig`` quantised linear, out x in in the model dtype)."""
    item = model.dtype.itemsize
    per: dict[torch.device, int] = {}
    for _, ql, _ in _dense_linears(model, PrecisionPolicy.parse(policy)):
        dev = ql.weight.device if ql.qweight is None else ql.qweight.device
        per[dev] = per.get(dev, 0) + ql.out_features * ql.in_features * item
    return per


def largest_dense_bytes(model, policy) -> int:
    """The streamed run's peak extra weight memory: the largest single dense weight."""
    item = model.dtype.itemsize
    return max((ql.out_features * ql.in_features * item for _, ql, _ in streamed_linears(model, policy)), default=0)


def _assumed_free(free: "int | dict | None", device: torch.device) -> int:
    if isinstance(free, dict):
        v = free.get(device, free.get(str(device)))
        return free_bytes(device) if v is None else int(v)
    return free_bytes(device) if free is None else int(free)


def choose_streaming(model, policy, streaming=True, free: "int | dict | None" = None) -> tuple[bool, str]:
    """(stream?, why). ``streaming``: True / False force it; ``"auto"`` streams when on some device
    the dense weights would take more than FREE_FRACTION of its free memory (the rest is left to
    activations). ``free``: free bytes to assume (one number for every device, or a mapping
    device -> bytes) instead of asking the devices."""
    if not (streaming is True or streaming is False or streaming == "auto"):
        raise ValueError(f"streaming={streaming!r}: expected True, False or 'auto'")
    if streaming is True or streaming is False:
        return streaming, f"streaming={streaming}"
    need = dense_bytes(model, policy)
    if not need:
        return False, "auto: no quantised linear goes dense under this policy"
    for dev, n in need.items():
        have = _assumed_free(free, dev)
        if n > FREE_FRACTION * have:
            return True, (f"auto: dense weights {n / 2**30:.3f} GiB on {dev} > {FREE_FRACTION:.0%} of "
                          f"{have / 2**30:.3f} GiB free")
    return False, f"auto: dense weights {sum(need.values()) / 2**30:.3f} GiB fit in free memory"


# ---------------------------------------------------------------------------- the context
@contextlib.contextmanager
def streaming_precision(model, policy, originals: Originals | None = None) -> Iterator[dict]:
    """``with streaming_precision(model, policy, originals=...) as report:`` -- the policy in
    place with every ``bf16`` / ``orig`` quantised linear streamed (see the module doc). Modes,
    weights, sources and the experts' decode switches are put back on exit, also on an
    exception. The report: apply_precision's (``bytes_after`` = the policy's weight memory as a
    dense run would hold it), ``streamed_names``, ``swapped`` (replaced linears in ``orig``,
    swapped for real) and ``peak_bytes`` (largest streamed dense weight)."""
    policy = PrecisionPolicy.parse(policy)
    targets = ModelTargets.of(model)
    check_targets(model, policy, targets)
    dense = _dense_linears(model, policy, targets)
    if originals is None:
        for name, _, mode in dense:
            if mode == Mode.ORIG:
                NoOriginals().weight(name)  # raises: say so before anything changed
    swap = {name: policy.mode_for(name)[1] for name, ql, mode in dense if mode == Mode.ORIG and _replaced(ql)}
    saved = precision_state(model, targets)
    sources = {name: ql.weight_source for name, ql in targets.linears}
    experts: list = []
    try:
        # the modes (and the weight memory report a dense run would give); puts back any weight
        # an enclosing orig swap displaced
        report = apply_precision(model, _without_orig(policy, swap), originals, targets)
        model.precision_policy = policy
        plan = streamed_linears(model, policy, targets)
        for _, ql in targets.linears:
            ql.weight_source = None   # an enclosing streamed run's sources do not apply to this policy
        for name, ql, mode in plan:
            ql.weight_source = _orig_source(name, ql, originals, model.dtype) if mode == Mode.ORIG else _bf16_source(ql)
            ql.set_mode(Mode.W4A16)  # drops a dense cache an earlier bf16 run may have left ...
            ql.set_mode(Mode.BF16)   # ... and back (act_scale kept)
        for mod in model.modules():
            if isinstance(mod, Experts) and any(isinstance(q, QLinear) and q.weight_source is not None
                                                for q in mod.modules()):
                experts.append((mod, mod.gather_in_decode, mod.kernel))
                mod.gather_in_decode, mod.kernel = False, None   # the per-expert loop: see the module doc
        yield {**report, "streamed_names": [name for name, _, _ in plan], "swapped": sorted(swap),
               "peak_bytes": max((ql.out_features * ql.in_features * model.dtype.itemsize for _, ql, _ in plan),
                                 default=0)}
    finally:
        for mod, gather, kernel in experts:
            mod.gather_in_decode, mod.kernel = gather, kernel
        for name, ql in targets.linears:
            ql.weight_source = sources.get(name)
        restore_precision(model, saved, targets)


@contextlib.contextmanager
def fitting_precision(model, policy, originals: Originals | None = None, streaming="auto",
                      free: "int | dict | None" = None) -> Iterator[dict]:
    """``policy`` in place the way that fits: :func:`streaming_precision` or ``using_precision``
    as :func:`choose_streaming` decides (same numbers either way). The report adds ``streamed``
    (bool) and ``how`` (which, and why)."""
    stream, why = choose_streaming(model, policy, streaming, free)
    ctx = streaming_precision if stream else using_precision
    with ctx(model, policy, originals) as report:
        yield {**report, "streamed": stream, "how": ("streamed: " if stream else "dense: ") + why}


__all__ = ["DENSE_MODES", "STREAM_ROWS", "choose_streaming", "dense_bytes", "dequantize_rows", "fitting_precision",
           "free_bytes", "largest_dense_bytes", "streamed_linears", "streaming_precision"]
