"""Host (Python) time of the kernel entry points in ``dsv4lab.kernels.dispatch``, measurable on a CPU.

Eager decode is host-bound (``launch_overhead.py``: one NVFP4 GEMV through ``quant_linear`` cost
173 us of host time on the H200 against 17-24 us for a bare Triton launch). ``--cpu-stub`` runs the
wrappers on CPU tensors with only the launches replaced: every ``@triton.jit`` kernel object of the
kernel modules becomes a stub whose ``kernel[grid](...)`` records (grid, args) and returns, the
CUDA checks answer as on an H200 (``Tensor.is_cuda`` True, ``have_triton_cuda`` / ``tma_supported``
/ ``tma_moe_supported`` True, capability 9.0, 132 SMs) and the rest of each wrapper (configs,
descriptors, allocations, env lookups, reshapes) runs as written. That isolates the wrapper cost
from Triton's own launch cost (``launch_overhead.py`` on the GPU measures both).

    python benchmarks/host_overhead.py --cpu-stub [--iters 300] [--profile quant_linear_nvfp4] [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib
import json
import os
import pkgutil
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SMS = 132  # an H200's SM count, what the stubbed num_sms answers


class StubKernel:
    """Stands in for a ``@triton.jit`` function: ``stub[grid](*args, **kw)`` appends
    (name, grid, args, kw) to ``log`` when recording and returns None."""

    def __init__(self, name: str, log: list | None):
        self.name = name
        self.log = log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if self.log is not None:
                self.log.append((self.name, grid, args, kwargs))
        return launch


def _kernel_modules() -> list:
    import dsv4lab.kernels as pkg

    mods = []
    for info in pkgutil.iter_modules(pkg.__path__):
        try:
            mods.append(importlib.import_module(f"dsv4lab.kernels.{info.name}"))
        except Exception:  # e.g. the CuTe module without cutlass: nothing of it is stubbed
            continue
    return mods


class StandInDriver:
    """What ``JITFunction.run`` asks of the driver, for an H200 that is not here (one device, stream 0)."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


class FakeCompiled:
    """What ``triton.compiler.compile`` returns under ``stubbed_launches(triton_run=True)``: the
    ``CompiledKernel`` attributes a launch uses; its launcher (``run``) appends (this object, grid,
    args, launch_enter_hook) to ``log`` and returns. ``src`` is Triton's ASTSource (signature,
    constants, attrs: the specialisation it was compiled for)."""

    log: list | None = None

    def __init__(self, src, target=None, options=None, **_):
        self.src, self.options = src, options
        self.function, self.packed_metadata = object(), object()
        self.run = self._launch

    def _launch(self, gx, gy, gz, stream, function, packed, launch_metadata, enter, exit_, *args):
        assert function is self.function and packed is self.packed_metadata
        if FakeCompiled.log is not None:
            FakeCompiled.log.append((self, (gx, gy, gz), args, enter))

    def launch_metadata(self, grid, stream, *args):
        return None


@contextlib.contextmanager
def fake_triton(log: list | None = None):
    """Within: ``JITFunction.run`` runs for real on a ``StandInDriver`` and compiles to ``FakeCompiled``
    (launches appended to ``log``). On exit the kernels' compile caches made here and the direct
    launch caches (``dsv4lab.kernels.launch.clear``) are dropped and the driver restored."""
    import triton
    import triton.compiler
    from triton.runtime.jit import JITFunction

    from dsv4lab.kernels import launch as launch_mod

    kernels = [v for m in _kernel_modules() for v in vars(m).values() if isinstance(v, JITFunction)]
    fresh = [k for k in kernels if not k.device_caches]
    old_compile, old_log = triton.compiler.compile, FakeCompiled.log
    old_driver = getattr(triton.runtime.driver, "_active", None)  # None: not created yet (no GPU here)
    triton.runtime.driver.set_active(StandInDriver())
    triton.compiler.compile = FakeCompiled
    FakeCompiled.log = log
    launch_mod.clear()
    try:
        yield log
    finally:
        triton.compiler.compile, FakeCompiled.log = old_compile, old_log
        triton.runtime.driver._active = old_driver
        for k in fresh:
            k.device_caches.clear()
        launch_mod.clear()


@contextlib.contextmanager
def stubbed_launches(log: list | None = None, triton_run: bool = False):
    """Within: kernels are ``StubKernel`` s (``triton_run``: real ``JITFunction`` s under ``fake_triton``),
    CPU tensors pass for CUDA tensors of an sm_90 device. Everything is restored on exit (the caches
    the wrappers filled stay: clear them if needed)."""
    from triton.runtime.jit import JITFunction

    from dsv4lab.kernels import device as dev_mod

    undo: list[tuple[object, str, object]] = []

    def patch(obj, name, value):
        undo.append((obj, name, obj.__dict__.get(name, _MISSING) if isinstance(obj, type) else getattr(obj, name)))
        setattr(obj, name, value)

    for mod in _kernel_modules():
        for name, val in list(vars(mod).items()):
            if isinstance(val, JITFunction) and not triton_run:
                patch(mod, name, StubKernel(f"{mod.__name__.rsplit('.', 1)[-1]}.{name}", log))
        if hasattr(mod, "tma_supported"):
            patch(mod, "tma_supported", lambda x, packed, scale: packed.shape[1] * 2 % 256 == 0)
        if hasattr(mod, "num_sms"):
            patch(mod, "num_sms", lambda device: SMS)
    # the real switch's read (env_value: ~0.1 us), not os.environ.get's ~1 us: 24 reads a CSA step
    patch(dev_mod, "have_triton_cuda", lambda: dev_mod.env_value("DSV4LAB_NO_KERNELS", "0") != "1")
    patch(torch.Tensor, "is_cuda", property(lambda self: True))
    patch(torch.cuda, "current_device", lambda: -1)   # CPU tensors' get_device() is -1: "current"
    patch(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    patch(torch.cuda, "is_current_stream_capturing", lambda: False)
    _stub_device_type(patch)
    ctx = fake_triton(log) if triton_run else contextlib.nullcontext()
    try:
        with ctx:
            yield log
    finally:
        for obj, name, old in reversed(undo):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


_MISSING = object()


def _stub_device_type(patch) -> None:
    """``linear_nvfp4._use_tma`` also asks ``x2.device.type == "cuda"``: the same checks without it."""
    from dsv4lab.kernels import linear_nvfp4

    def _use_tma(x2, packed, scale):
        if x2.shape[0] > 16 or os.environ.get("DSV4LAB_KERNEL_TMA", "1") == "0":
            return False
        return linear_nvfp4.tma_supported(x2, packed, scale)

    patch(linear_nvfp4, "_use_tma", _use_tma)


# ----------------------------------------------------------------------------- the calls
def decode_calls(dtype=torch.bfloat16, device: str = "cpu") -> dict:
    """name -> zero-argument callable running one dispatch entry point at a V4-Pro decode shape (one
    token), on CPU tensors (with ``stubbed_launches`` active) or on ``device`` (the GPU tests)."""
    from dsv4lab.config import named_config
    from dsv4lab.kernels import dispatch
    from dsv4lab.model.compressor import Compressor
    from dsv4lab.model.state import CompressorState
    from dsv4lab.quant.stacked import stack_experts
    from dsv4lab.quant.weights import quantize_fp8_block, quantize_mxfp4, quantize_nvfp4

    g = torch.Generator().manual_seed(0)
    cfg = named_config("v4-pro")
    H = cfg.hidden_size
    x = torch.randn(1, H, generator=g).to(device).to(dtype)
    w_nv = quantize_nvfp4(torch.randn(512, H, generator=g).to(device))
    w_mx = quantize_mxfp4(torch.randn(512, H, generator=g).to(device))
    w_f8 = quantize_fp8_block(torch.randn(512, H, generator=g).to(device))
    E, I, k = 8, 512, 6  # a few experts: the wrapper cost does not depend on E
    experts = [[quantize_nvfp4(torch.randn(*shape, generator=g).to(device) * 0.02) for _ in range(E)]
               for shape in ((I, H), (I, H), (H, I))]
    w1, w3, w2 = (stack_experts(ws) for ws in experts)
    ids = torch.tensor([[0, 1, 2, 3, 4, 5]], device=device)
    wts = torch.rand(1, k, generator=g).to(device)
    hc, B = cfg.hc_mult, 1
    streams = torch.randn(B, 1, hc, H, generator=g).to(device).to(dtype)
    mix = (2 + hc) * hc
    fn, base, scale = torch.randn(mix, hc * H, generator=g).to(device), torch.randn(mix, generator=g).to(device), torch.ones(3, device=device)
    block_out = torch.randn(B, 1, H, generator=g).to(device).to(dtype)
    post, comb = torch.rand(B, 1, hc, generator=g).to(device), torch.rand(B, 1, hc, hc, generator=g).to(device)
    Hq, D = cfg.num_attention_heads, cfg.head_dim
    q = torch.randn(B, 1, Hq, D, generator=g).to(device).to(dtype)
    sink = torch.zeros(Hq, device=device)
    ring = torch.randn(B, cfg.sliding_window, D, generator=g).to(device).to(dtype)
    entries = torch.randn(B, 1024, D, generator=g).to(device).to(dtype)
    pos = torch.tensor(4000, device=device)
    n_ent = torch.tensor(1000, device=device)
    selected = torch.randint(0, 1000, (B, 1, cfg.index_topk), generator=g).to(device)
    comp = Compressor(cfg, D, 4, True).to(device, dtype)
    st = CompressorState.empty(B, 4, D, True, 8192, dtype, device)
    kv, z = torch.randn(B, 1, 2 * D, generator=g).to(device).to(dtype), torch.randn(B, 1, 2 * D, generator=g).to(device).to(dtype)
    rope = cfg.qk_rope_head_dim
    inv_freq = torch.rand(rope // 2, generator=g).to(device)
    qh = torch.randn(B, 1, Hq, D, generator=g).to(device).to(dtype)
    positions = torch.tensor([4000], device=device)
    qn_w = torch.ones(D, dtype=dtype, device=device)
    logits = torch.randn(1, cfg.n_routed_experts, generator=g).to(device)
    bias = torch.zeros(cfg.n_routed_experts, device=device)
    return {
        "quant_linear_nvfp4": lambda: dispatch.quant_linear(x, w_nv),
        "quant_linear_mxfp4": lambda: dispatch.quant_linear(x, w_mx),
        "quant_linear_fp8_block": lambda: dispatch.quant_linear(x, w_f8),
        "moe_decode_nvfp4": lambda: dispatch.moe_decode(x, ids, wts, w1, w3, w2, 10.0),
        "mhc_pre": lambda: dispatch.mhc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6),
        "mhc_post": lambda: dispatch.mhc_post(streams, block_out, post, comb),
        "decode_attention_sparse": lambda: dispatch.decode_attention(q, sink, 0.1, ring, pos, entries, None, selected),
        "compressor_decode": lambda: dispatch.compressor_decode(comp, kv, z, pos, st),
        "norm_rope": lambda: dispatch.norm_rope(qh, positions, inv_freq, 1e-6, qn_w),
        "route": lambda: dispatch.route(logits, cfg.num_experts_per_tok, "sqrtsoftplus", 2.5, bias),
    }


def host_us(fn, iters: int, repeats: int = 7) -> float:
    """Best of ``repeats`` batches of ``iters // repeats`` calls, mean us per call (the machine this
    runs on is shared: the minimum is the wrapper's cost, the rest is other processes)."""
    for _ in range(20):
        fn()
    n = max(1, iters // repeats)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def _normal_vs_direct(fn, iters: int, log: list) -> dict:
    """Host us of ``fn`` with the direct launch path off, then on (``--triton-run``)."""
    from dsv4lab.kernels import launch as launch_mod

    n_launch = len(log)
    prev = launch_mod.set_direct_launch(False)
    try:
        normal = host_us(fn, iters)
        launch_mod.set_direct_launch(True)
        fn()
        launch_mod.stats["direct"] = 0
        fn()
        direct_launches = launch_mod.stats["direct"]
        direct = host_us(fn, iters)
    finally:
        launch_mod.set_direct_launch(prev)
    log.clear()
    return {"normal_us": round(normal, 1), "direct_us": round(direct, 1), "launches": n_launch,
            "direct_launches": direct_launches}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-stub", action="store_true", help="stub the launches, run on CPU tensors (required)")
    ap.add_argument("--triton-run", action="store_true",
                    help="real JITFunction.run over a fake compile: time each call with the direct launch off / on")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--only", default="", help="comma-separated call names")
    ap.add_argument("--profile", default="", help="cProfile this call, print the top entries")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not args.cpu_stub:
        ap.error("only --cpu-stub is implemented here; on the GPU run benchmarks/launch_overhead.py")
    torch.set_num_threads(1)
    os.environ["DSV4LAB_KERNEL_VERIFY"] = "0"  # the stubs write nothing: the first-use parity check would fail
    log: list = []
    with stubbed_launches(log, triton_run=args.triton_run):
        calls = decode_calls()
        names = [n for n in calls if not args.only or n in args.only.split(",")]
        res = {}
        for n in names:
            log.clear()
            calls[n]()
            if args.triton_run:
                res[n] = _normal_vs_direct(calls[n], args.iters, log)
                print(f"{n:26s} normal {res[n]['normal_us']:8.1f} us  direct {res[n]['direct_us']:8.1f} us  "
                      f"({res[n]['launches']} launches, {res[n]['direct_launches']} direct)", flush=True)
                continue
            launches = [e[0] for e in log]
            res[n] = {"us": round(host_us(calls[n], args.iters), 1), "launches": launches}
            print(f"{n:26s} {res[n]['us']:8.1f} us  {', '.join(launches)}", flush=True)
        if args.profile:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(args.iters):
                calls[args.profile]()
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
