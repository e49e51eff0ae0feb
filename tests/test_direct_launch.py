"""The direct launch path (``dsv4lab.kernels.launch``): on CPU through the real ``JITFunction.run``
over a fake compile (``benchmarks/host_overhead.py`` ``fake_triton``), every launch, direct or not,
must reach the compiled kernel Triton's own cache picks for those arguments; on the H200
(``-m gpu``) the decode kernels must give bitwise the outputs of the normal launch, eagerly and
under CUDA-graph replay."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from test_host_overhead import _host_overhead  # noqa: E402  (benchmarks/host_overhead.py as a module)

ROOT = Path(__file__).resolve().parents[1]


@triton.jit
def _probe_kernel(x_ptr, y_ptr, n, m, s, B: tl.constexpr, F: tl.constexpr):
    i = tl.arange(0, B)
    tl.store(y_ptr + i, tl.load(x_ptr + i) * s + n + m + F)


@pytest.fixture
def fake():
    """(launch module, launch log) with Triton's run over a fake compile; direct path on."""
    from dsv4lab.kernels import launch as L

    ho = _host_overhead()
    log: list = []
    with ho.fake_triton(log):
        _probe_kernel.device_caches.clear()
        prev = L.set_direct_launch(True)
        try:
            yield L, log
        finally:
            L.set_direct_launch(prev)
            _probe_kernel.device_caches.clear()


def _expected(kernel, args, kw):
    """The compiled kernel Triton's own run() picks for these arguments (warmup: compiles, no launch)."""
    return kernel.run(*args, grid=(1,), warmup=True, **kw)


def _check(L, log, args, kw, direct: bool):
    n0 = L.stats["direct"]
    L.launch(_probe_kernel, (2, 1), *args, **kw)
    compiled, grid, passed, enter = log[-1]
    assert compiled is _expected(_probe_kernel, args, kw)
    assert grid == (2, 1, 1)
    assert passed[:len(args)] == tuple(args) and passed[len(args):] == (kw["B"], kw["F"])
    assert (L.stats["direct"] == n0 + 1) is direct
    assert (enter is None) if direct else True


def test_repeat_goes_direct_and_changes_do_not(fake):
    assert fake[0].direct_launch_enabled(), "the direct launch must be supported by the installed triton"
    L, log = fake
    x, y = torch.zeros(64), torch.zeros(64)
    kw = dict(B=16, F=1)
    _check(L, log, (x, y, 3, 32, 1.0), kw, direct=False)      # first: compiles through run()
    _check(L, log, (x, y, 5, 48, 2.0), kw, direct=True)       # same classes: direct
    _check(L, log, (x[1:], y, 5, 48, 2.0), kw, direct=False)  # misaligned pointer: new key
    _check(L, log, (x[1:], y, 5, 48, 2.0), kw, direct=True)
    _check(L, log, (x.double(), y, 5, 48, 2.0), kw, direct=False)   # another dtype
    _check(L, log, (x, y, 1, 48, 2.0), kw, direct=False)      # int == 1: a constexpr for Triton
    _check(L, log, (x, y, 16, 48, 2.0), kw, direct=False)     # divisible by 16
    _check(L, log, (x, y, 2 ** 40, 48, 2.0), kw, direct=False)  # i64
    _check(L, log, (x, y, True, 48, 2.0), kw, direct=False)   # bool is not int
    _check(L, log, (x, y, 3, 48, 2), kw, direct=False)        # int where a float was
    _check(L, log, (x, y, 3, 32, 1.0), dict(B=16, F=2), direct=False)   # another constexpr value
    _check(L, log, (x, y, 3, 32, 1.0), dict(B=16, F=1.0), direct=False)  # same value, another type
    _check(L, log, (x, y, 3, 32, 1.0), dict(B=16, F=1.0), direct=True)
    _check(L, log, (x, y, 5, 48, 2.0), kw, direct=True)       # the first entry still there


def test_switch_hooks_and_layouts_take_the_normal_path(fake):
    assert fake[0].direct_launch_enabled(), "the direct launch must be supported by the installed triton"
    L, log = fake
    from triton import knobs

    x, y = torch.zeros(64), torch.zeros(64)
    args, kw = (x, y, 3, 32, 1.0), dict(B=16, F=1)
    _check(L, log, args, kw, direct=False)
    _check(L, log, args, kw, direct=True)
    L.set_direct_launch(False)
    _check(L, log, args, kw, direct=False)
    L.set_direct_launch(True)
    seen: list = []
    hook = knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):   # a profiler's launch hook: Triton's own path, which hands the launcher the hook
        hook.add(seen.append)
        try:
            _check(L, log, args, kw, direct=False)
        finally:
            hook.remove(seen.append)
        assert log[-1][3] is hook
    knobs.runtime.debug = True
    try:
        assert not L._triton_state_plain()
    finally:
        knobs.runtime.debug = False
    _check(L, log, args, kw, direct=True)
    # a constexpr passed positionally cannot be keyed by class: that layout stays normal
    n0 = L.stats["direct"]
    for _ in range(2):
        L.launch(_probe_kernel, (1,), x, y, 3, 32, 1.0, 16, F=1)
    assert L.stats["direct"] == n0
    # a tensor by keyword: normal
    for _ in range(2):
        L.launch(_probe_kernel, (1,), x, n=3, m=32, s=1.0, y_ptr=y, B=16, F=1)
    assert L.stats["direct"] == n0


def test_fixed_positions_are_checked_by_identity(fake):
    assert fake[0].direct_launch_enabled(), "the direct launch must be supported by the installed triton"
    L, log = fake
    x, y = torch.zeros(64), torch.zeros(64)
    site = L.LaunchSite(_probe_kernel, fixed=(2, 3), B=16, F=1)
    n, m = 3, 4096
    for direct in (False, True, True):
        n0 = L.stats["direct"]
        site((1,), x, y, n, m, 1.0)
        assert (L.stats["direct"] == n0 + 1) is direct
        assert log[-1][0] is _expected(_probe_kernel, (x, y, n, m, 1.0), dict(B=16, F=1))
    n0, k0 = L.stats["direct"], L.normal_by_kernel["_probe_kernel"]
    site((1,), x, y, n, 4096 + 16, 1.0)   # another object at a fixed position: normal, right kernel
    assert L.stats["direct"] == n0 and L.normal_by_kernel["_probe_kernel"] == k0 + 1   # counted by kernel
    assert log[-1][0] is _expected(_probe_kernel, (x, y, n, 4096 + 16, 1.0), dict(B=16, F=1))
    L.clear()
    assert site.key is None and not site.entries and not L.normal_by_kernel


def test_interpreter_never_goes_direct():
    """Under TRITON_INTERPRET=1 (CPU CI) the module reports the path off and cannot switch it on."""
    import subprocess

    code = ("import os; os.environ['TRITON_INTERPRET'] = '1'\n"
            "from dsv4lab.kernels import launch as L\n"
            "assert not L.direct_launch_enabled(); L.set_direct_launch(True); assert not L.direct_launch_enabled()\n")
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_env_switch_off():
    import os
    import subprocess

    code = "from dsv4lab.kernels import launch as L\nassert not L.direct_launch_enabled()\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DSV4LAB_DIRECT_LAUNCH": "0"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_decode_entry_points_go_direct_on_repeat(monkeypatch):
    """Every decode entry point of ``host_overhead.decode_calls`` launches only directly on its second
    call, and each launch reaches the kernel compiled for its arguments (same as the normal path)."""
    from dsv4lab.kernels import launch as L

    ho = _host_overhead()
    assert L.direct_launch_enabled(), "the direct launch must be supported by the installed triton"
    monkeypatch.setenv("DSV4LAB_KERNEL_VERIFY", "0")  # the stubs write nothing (restored after the test)
    log: list = []
    with ho.stubbed_launches(log, triton_run=True):
        calls = ho.decode_calls()
        for name, fn in calls.items():
            fn()
            log.clear()
            n0, m0 = L.stats["direct"], L.stats["normal"]
            fn()
            assert L.stats["normal"] == m0, name
            assert L.stats["direct"] - n0 == len(log) > 0, name
            direct = [(c, g, a) for c, g, a, _ in log]
            log.clear()
            prev = L.set_direct_launch(False)
            try:
                fn()
            finally:
                L.set_direct_launch(prev)
            normal = [(c, g) for c, g, a, _ in log]
            assert [(c, g) for c, g, _ in direct] == normal, name


class _Desc:
    """A stand-in TensorDescriptor: what ``_expanded`` reads (base, its own __dict__)."""

    def __init__(self, base):
        self.base = base


def _fake_triton36(scratch: int = 0):
    """A module laid out as Triton 3.6's NVIDIA driver: ``CudaLauncher`` whose ``launch`` wraps the
    C launcher in a closure over (launcher, tensordesc_indices, tensordesc_meta), a 2-argument
    ``make_tensordesc_arg``; returns (module, launcher object, C-launch log, encode log)."""
    import types

    mod = types.ModuleType("fake_triton36_driver")
    mod._BASE_ARGS_FORMAT = "iiiKKppOOOOOO"
    encoded: list = []
    mod.__dict__["make_tensordesc_arg"] = lambda arg, metadata: make_tensordesc_arg(arg, metadata)
    c_log: list = []

    def make_tensordesc_arg(arg, metadata):
        encoded.append((arg.base.data_ptr(), metadata))
        return [("map", arg.base.data_ptr(), metadata), 7, 9]

    def c_launch(*args):
        c_log.append(args)

    # Triton's wrapper, its globals the driver module's (a closure over exactly these three names)
    src = ("def wrap(launcher, tensordesc_indices, tensordesc_meta):\n"
           "    def inner(*args):\n"
           "        final = list(args[:13])\n"
           "        k = 0\n"
           "        for i, a in enumerate(args[13:]):\n"
           "            if i in tensordesc_indices:\n"
           "                final.extend(make_tensordesc_arg(a, tensordesc_meta[k]))\n"
           "                k += 1\n"
           "            else:\n"
           "                final.append(a)\n"
           "        return launcher(*final)\n"
           "    return inner\n")
    exec(src, mod.__dict__)
    wrap = mod.wrap

    class CudaLauncher:
        def __init__(self):
            self.launch = wrap(c_launch, {1, 3}, ["m1", "m3"])
            self.global_scratch_size = scratch
            self.profile_scratch_size = 0
            self.launch_cooperative_grid = False
            self.launch_pdl = True

        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                        None, None, *args)

    CudaLauncher.__module__ = mod.__name__
    mod.CudaLauncher = CudaLauncher
    return mod, CudaLauncher(), c_log, encoded


def test_raw_launch_calls_the_c_launcher_as_tritons_wrapper_would(monkeypatch):
    """A Triton 3.6-shaped launcher: ``raw_caller`` hands the C launcher exactly the arguments Triton's
    own Python path does, and encodes a descriptor again only when its base tensor or address changed."""
    from dsv4lab.kernels import launch as L

    mod, run, c_log, encoded = _fake_triton36()
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    call = L.raw_caller(run, 5)
    assert call is not None
    w, x1, x2 = torch.zeros(16), torch.zeros(16), torch.zeros(16)
    wd, tail = _Desc(w), (64,)
    for x in (x1, x1, x2):
        xd = _Desc(x)                                  # a new activation descriptor per call, as rebased() makes
        args = (w, wd, 3, xd)
        run(4, 1, 1, 99, "fn", "md", None, None, None, *args, *tail)   # Triton's own path
        want = c_log.pop()
        call(4, 1, 1, 99, "fn", "md", args, tail)
        assert c_log.pop() == want
    # the weight descriptor was encoded once per path call of Triton's own (3) and once by the raw
    # path (kept after); the activation descriptors every time (each is a new object)
    assert [e[0] for e in encoded].count(w.data_ptr()) == 3 + 1
    assert len(encoded) == 3 + 1 + 3 + 3
    w2 = torch.zeros(16)
    wd.base = w2                                       # the same descriptor object over another tensor
    call(4, 1, 1, 99, "fn", "md", (w, wd, 3, _Desc(x1)), tail)
    assert c_log.pop()[14][1] == w2.data_ptr()


def test_raw_launch_encodes_slotted_descriptors_every_time(monkeypatch):
    """A descriptor class without an instance dict has nowhere to keep its map: encoded per launch."""
    from dsv4lab.kernels import launch as L

    class Slotted:
        __slots__ = ("base",)

        def __init__(self, base):
            self.base = base

    mod, run, c_log, encoded = _fake_triton36()
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    call = L.raw_caller(run, 5)
    w = torch.zeros(16)
    wd = Slotted(w)
    for _ in range(3):
        call(1, 1, 1, 0, "fn", "md", (w, wd, 3, Slotted(w)), (64,))
    assert len(encoded) == 6 and c_log[-1][14] == ("map", w.data_ptr(), "m1")


def test_raw_launch_refuses_other_layouts(monkeypatch):
    """Scratch memory, another driver layout or a stand-in launcher: no raw caller (Triton's path stays)."""
    from dsv4lab.kernels import launch as L

    mod, run, _, _ = _fake_triton36(scratch=128)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    assert L.raw_caller(run, 5) is None
    mod, run, _, _ = _fake_triton36()
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    mod._BASE_ARGS_FORMAT = "iiiKKppOOOOOOO"          # a launcher taking other leading arguments
    assert L.raw_caller(run, 5) is None
    mod._BASE_ARGS_FORMAT = "iiiKKppOOOOOO"
    assert L.raw_caller(run, 2) is None                # descriptor positions beyond the arguments
    assert L.raw_caller(lambda *a: None, 5) is None    # not a CudaLauncher


# ----------------------------------------------------------------------------- GPU (the H200)
def _outputs(v):
    """The tensors a call returned, flattened (clones: later calls may reuse buffers)."""
    if isinstance(v, torch.Tensor):
        return [v.detach().clone()]
    if isinstance(v, (tuple, list)):
        return [t for x in v for t in _outputs(x)]
    return []


def _bitwise(a: list, b: list, name: str) -> None:
    assert len(a) == len(b) > 0, name
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.view(torch.uint8) if x.dtype.is_floating_point else x,
                           y.view(torch.uint8) if y.dtype.is_floating_point else y), name


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the device machine)")

# compressor_decode writes its state: its outputs depend on how often it ran, not on the launch path
_STATEFUL = {"compressor_decode"}


@pytest.fixture
def gpu_calls(monkeypatch):
    from dsv4lab.kernels import launch as L

    assert L.direct_launch_enabled(), "the direct launch must be on (unset DSV4LAB_DIRECT_LAUNCH) and supported"
    monkeypatch.setenv("DSV4LAB_KERNEL_VERIFY", "0")
    return L, _host_overhead().decode_calls(torch.bfloat16, "cuda")


@pytest.mark.gpu
@needs_cuda
def test_gpu_direct_matches_normal_bitwise(gpu_calls):
    """(a) each decode entry point at V4-Pro shapes: the direct launches (second call on) give bitwise
    the outputs of the normal launches, and they were direct."""
    L, calls = gpu_calls
    for name, fn in calls.items():
        if name in _STATEFUL:
            continue
        prev = L.set_direct_launch(False)
        try:
            fn()
            normal = _outputs(fn())
        finally:
            L.set_direct_launch(prev)
        fn()
        n0, r0 = L.stats["direct"], L.stats["raw"]
        direct = _outputs(fn())
        torch.cuda.synchronize()
        assert L.stats["direct"] > n0, f"{name}: no direct launch"
        if triton.__version__.startswith("3.6."):  # the launcher layout raw_caller knows: it must be used
            assert L.stats["raw"] > r0, f"{name}: no raw launch on triton {triton.__version__}"
        _bitwise(direct, normal, name)


@pytest.mark.gpu
@needs_cuda
def test_gpu_graph_replay_of_direct_launches_matches_eager(gpu_calls):
    """(b) a step of every (stateless) decode entry point captured in a CUDA graph while the direct path
    is on replays bitwise equal to the eager direct run."""
    L, calls = gpu_calls
    names = [n for n in calls if n not in _STATEFUL]
    for n in names:
        calls[n]()
    eager = {n: _outputs(calls[n]()) for n in names}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for n in names:
            calls[n]()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    n0 = L.stats["direct"]
    with torch.cuda.graph(graph):
        outs = {n: calls[n]() for n in names}
    assert L.stats["direct"] > n0
    graph.replay()
    torch.cuda.synchronize()
    for n in names:
        _bitwise(_outputs(outs[n]), eager[n], n)


@pytest.mark.gpu
@needs_cuda
def test_gpu_misaligned_view_and_other_dtype_after_caching():
    """(c) after the GEMV and the norm kernel went direct: a 2-byte-offset activation view and an fp16
    activation still give the normal launch's result (new specialisations, not the cached kernel)."""
    from dsv4lab.kernels import dispatch
    from dsv4lab.kernels import launch as L
    from dsv4lab.quant.weights import quantize_nvfp4

    assert L.direct_launch_enabled(), "the direct launch must be on (unset DSV4LAB_DIRECT_LAUNCH) and supported"
    g = torch.Generator().manual_seed(1)
    K, N = 7168, 1536
    w = quantize_nvfp4(torch.randn(N, K, generator=g).cuda())
    buf = torch.randn(1, K + 8, generator=g).cuda().to(torch.bfloat16)
    x = buf[:, :K].contiguous()
    x_mis = buf[:, 1:K + 1]                       # data_ptr % 16 == 2
    assert x_mis.data_ptr() % 16 and x_mis.is_contiguous()
    nw = torch.ones(1536, dtype=torch.bfloat16, device="cuda")   # q_norm's width

    def run(xx):
        return _outputs((dispatch.quant_linear(xx, w), dispatch.rms_norm(xx[:, :1536], nw, 1e-6)))

    for _ in range(3):
        run(x)                                    # cached, direct
    for xx in (x_mis, x.half(), x_mis.contiguous()):
        prev = L.set_direct_launch(False)
        try:
            want = run(xx)
        finally:
            L.set_direct_launch(prev)
        got1, got2 = run(xx), run(xx)             # first on a new key (normal), then direct
        torch.cuda.synchronize()
        _bitwise(got1, want, f"{xx.dtype} {xx.data_ptr() % 16}")
        _bitwise(got2, want, f"{xx.dtype} {xx.data_ptr() % 16}")
