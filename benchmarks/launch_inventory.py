"""What one decode step of a V4-Pro layer launches, per component, with all kernels installed.

Issue #24 counts kernels per step under CUDA-graph replay (the H200: CSA 97, HCA 63 before this
script). Every launch is a Triton kernel of ``dsv4lab.kernels`` or an aten op; this script records
both while the layer's ``decode`` runs once, and names the innermost component (a module of the
layer) whose method was on the Python stack at the time.

* ``--cpu-stub`` (any machine): the layer on CPU tensors with the launches stubbed as in
  ``host_overhead.py --cpu-stub`` (kernels record and return, CUDA checks answer as on an H200),
  the kernels installed as ``install_kernels`` would on CUDA. Aten ops are recorded by a
  ``TorchDispatchMode``; ops that launch no CUDA kernel (views, ``empty``) are left out, and the
  estimate counts each remaining op as its usual CUDA kernels (``KERNELS_PER_OP``: a BF16 M = 1
  matmul is cuBLAS splitK + its reduce, a ``topk`` a radix select + sort).
* on CUDA (default there): the same recording around real launches, plus the CUDA profiler's
  kernel list of the step (the ground truth; the count a graph replay shows).

``--prefill S``: the same for one prefill of an S-token prompt from position 0 (what every
triage evaluation runs: notebook 3 evaluates an 11-token prompt ~200 times). Under the stubs the
router runs its reference there (stubbed route launches would hand the MoE garbage expert ids).

Shapes: V4-Pro's, with ``--experts`` routed experts (8 by default; the count of experts does not
change which kernels launch) so the layer fits a CPU. Batch 1, position 1000, 4096 positions.

    python benchmarks/launch_inventory.py --cpu-stub [--json out.json] [--layer csa|hca]
    python3 benchmarks/launch_inventory.py --json $OUT/inv.json        # on the GPU
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
from collections import Counter
from pathlib import Path
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LAYERS = {"csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention"}

# aten ops that launch no CUDA kernel: views, metadata, allocation
NO_KERNEL = {
    "view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "unsqueeze", "squeeze", "slice", "select",
    "as_strided", "alias", "detach", "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty",
    "new_empty_strided", "unbind", "split", "split_with_sizes", "chunk", "narrow", "view_as", "expand_as", "flatten",
    "unflatten", "diagonal", "movedim", "_reshape_alias", "is_same_size", "sym_size", "sym_stride", "sym_numel",
    "sym_storage_offset", "set_", "resize_", "_local_scalar_dense", "promote_types", "result_type", "is_nonzero",
}
# aten op -> the CUDA kernels it usually launches at decode shapes (the rest: one)
KERNELS_PER_OP = {"mm": 2, "addmm": 2, "bmm": 2, "matmul": 2, "linear": 2, "topk": 2}


def _op_name(func) -> str:
    return func.overloadpacket.__name__.rstrip("_") if func.overloadpacket.__name__ != "_" else "_"


class _Recorder(TorchDispatchMode):
    """Appends (component, op name) for every aten op that launches a kernel."""

    def __init__(self, where, log: list):
        super().__init__()
        self.where = where
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name.rstrip("_") not in NO_KERNEL and name not in NO_KERNEL:
            self.log.append((self.where(), name))
        return func(*args, **(kwargs or {}))


def component_locator(layer: torch.nn.Module):
    """() -> the name of the innermost module of ``layer`` whose method is on the caller's stack."""
    names = {id(m): n or "layer" for n, m in layer.named_modules()}

    def where() -> str:
        f = sys._getframe(2)
        while f is not None:
            me = f.f_locals.get("self")
            if me is not None and id(me) in names:
                return names[id(me)]
            f = f.f_back
        return "?"

    return where


def _host_overhead():
    spec = importlib.util.spec_from_file_location("host_overhead", Path(__file__).resolve().parent / "host_overhead.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("host_overhead", mod)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def counted_launches(where, log: list, stub: bool):
    """Within: every ``@triton.jit`` kernel of ``dsv4lab.kernels`` records (component, name) in
    ``log``; ``stub``: and does nothing else (CPU tensors pass for an H200's, see host_overhead)."""
    from triton.runtime.jit import JITFunction

    from dsv4lab.kernels import launch as direct_launch  # lazy, as triton above

    ho = _host_overhead()
    if stub:
        raw: list = []

        class _Log(list):  # the stub appends (name, grid, args, kw): keep (component, name)
            def append(self, e):
                log.append((where(), e[0]))

        with ho.stubbed_launches(_Log(raw)) as s:
            yield s
        return
    # On a GPU: count at JITFunction.run (patching the module globals would hand Triton's
    # dependency walk objects it deep-copies), with the direct launch off so every launch goes
    # through run.
    real_run = JITFunction.run

    def run(self, *args, **kwargs):
        if not kwargs.get("warmup", False):
            log.append((where(), f"{self.fn.__module__.rsplit('.', 1)[-1]}.{self.fn.__name__}"))
        return real_run(self, *args, **kwargs)

    was_direct = direct_launch.set_direct_launch(False)
    JITFunction.run = run
    try:
        yield log
    finally:
        JITFunction.run = real_run
        direct_launch.set_direct_launch(was_direct)


@contextlib.contextmanager
def _cpu_install_allowed():
    """``install_kernels`` checks the parameters' device type: let CPU ones pass (with the stubs)."""
    from dsv4lab.kernels import install

    saved = install._on_cuda, install.have_triton_cuda
    install._on_cuda = lambda t: t is not None
    install.have_triton_cuda = lambda: True
    try:
        yield
    finally:
        install._on_cuda, install.have_triton_cuda = saved


def build(layer_type: str, dev, experts: int, helpers: str = "bf16"):
    """The V4-Pro layer of ``decode.py`` (NVFP4; helper projections BF16 or, ``helpers="quantised"``,
    NVFP4 as the export stores them) with ``experts`` routed experts."""
    from benchmarks import decode as bench

    saved = dict(bench.V4_PRO)
    bench.V4_PRO["n_routed_experts"] = experts
    try:
        return bench.build_layer(layer_type, dev, helpers=helpers)
    finally:
        bench.V4_PRO.clear()
        bench.V4_PRO.update(saved)


def inventory(layer_type: str, stub: bool, experts: int = 8, prefill: int = 0, helpers: str = "bf16") -> dict:
    """Launches of one decode step: per component the Triton kernels and the kernel-launching aten
    ops (with counts), the totals and the estimated CUDA kernels; on CUDA also the profiler's.
    The stubs write nothing, so the first-use parity check is off meanwhile (and only meanwhile:
    a caller's environment, e.g. a test process, is restored)."""
    with mock.patch.dict(os.environ, {"DSV4LAB_KERNEL_VERIFY": "0"}):
        return _inventory(layer_type, stub, experts, prefill, helpers)


def _inventory(layer_type: str, stub: bool, experts: int, prefill: int, helpers: str) -> dict:
    from dsv4lab.kernels.install import install_kernels
    from dsv4lab.model.state import DecodeState

    dev = torch.device("cpu" if stub else "cuda")
    layer, cfg, _ = build(layer_type, dev, experts, helpers)
    st = DecodeState.allocate(cfg, 1, 4096, torch.bfloat16, dev)
    S = max(prefill, 1)
    h = torch.randn(1, S, cfg.hc_mult, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    ids = torch.zeros(1, S, dtype=torch.long, device=dev)
    pos = st.pos_on(dev)
    pos.fill_(1000)
    if prefill:
        def step():
            return layer.prefill(h, ids, 0, st.layers[0])
    else:
        def step():
            return layer.decode(h, ids, pos, st.layers[0])
    where = component_locator(layer)
    log: list = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(counted_launches(where, log, stub))
        if stub:
            stack.enter_context(_cpu_install_allowed())
        installed = install_kernels(layer)
        if stub:  # Experts asks its input's device type: let the CPU stand in for CUDA
            for m in layer.modules():
                if hasattr(m, "kernel_devices"):
                    m.kernel_devices = ("cuda", "cpu")
                if prefill and hasattr(m, "route_kernel"):
                    m.route_kernel = None
        step()  # warm caches (plans, expert stacks)
        log.clear()
        with _Recorder(where, log):
            step()
    triton_names = {n for _, n in log if "." in n}
    per: dict[str, dict] = {}
    for comp, name in log:
        kind = "triton" if name in triton_names else "aten"
        per.setdefault(comp, {"triton": Counter(), "aten": Counter()})[kind][name] += 1
    n_triton = sum(sum(v["triton"].values()) for v in per.values())
    n_aten = sum(sum(v["aten"].values()) for v in per.values())
    est = n_triton + sum(KERNELS_PER_OP.get(n.rstrip("_"), 1) * c for v in per.values() for n, c in v["aten"].items())
    res = {"layer_type": layer_type, "step": f"prefill {prefill} tokens" if prefill else "decode", "installed": installed, "triton_launches": n_triton, "aten_ops": n_aten,
           "estimated_cuda_kernels": est,
           "components": {c: {k: dict(v[k]) for k in ("triton", "aten")} for c, v in sorted(per.items())}}
    if not stub:
        from benchmarks.measure import kernels_per_call

        with torch.no_grad():
            prof = kernels_per_call(step, reps=2, top=200)
        res["profiler_kernels"] = prof["kernels"]
        res["profiler_top_us"] = prof["top_us"]
    return res


def print_inventory(r: dict) -> None:
    print(f"== {r['layer_type']}, {r['step']}: {r['triton_launches']} Triton launches + {r['aten_ops']} aten ops "
          f"(~{r['estimated_cuda_kernels']} CUDA kernels)" +
          (f"; profiler: {r['profiler_kernels']:.0f} kernels" if "profiler_kernels" in r else ""))
    for comp, v in r["components"].items():
        parts = [f"{n} x{c}" if c > 1 else n for n, c in {**v["triton"], **v["aten"]}.items()]
        print(f"  {comp:28s} {sum(v['triton'].values()):3d} triton {sum(v['aten'].values()):3d} aten  {', '.join(parts)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-stub", action="store_true", help="CPU tensors, launches stubbed (default without CUDA)")
    ap.add_argument("--layer", choices=("csa", "hca", "both"), default="both")
    ap.add_argument("--experts", type=int, default=8, help="routed experts of the layer (V4-Pro: 384)")
    ap.add_argument("--prefill", type=int, default=0, metavar="S",
                    help="inventory one prefill of an S-token prompt instead of a decode step")
    ap.add_argument("--helpers", choices=("bf16", "quantised"), default="bf16",
                    help="compressor / indexer helper projections: BF16 (our users' engine) or quantised (the NVFP4 export)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.prefill < 0:
        ap.error(f"--prefill must be >= 0 tokens, got {args.prefill}")
    stub = args.cpu_stub or not torch.cuda.is_available()
    torch.set_num_threads(1 if stub else torch.get_num_threads())
    out = []
    for key in (("csa", "hca") if args.layer == "both" else (args.layer,)):
        r = inventory(LAYERS[key], stub, args.experts, args.prefill, args.helpers)
        r["mode"] = "cpu-stub" if stub else "cuda"
        print_inventory(r)
        out.append(r)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
