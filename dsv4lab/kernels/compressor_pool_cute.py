"""CuTeDSL kernel for the compressor's softmax pooling (``Compressor.pool``, the part before kv_norm).

Why: ``Compressor.pool`` spends four PyTorch launches and three full-size temporaries on
``w = softmax(gate, dim=2)`` / ``w.to(kv.dtype)`` / ``kv * w`` / ``.sum(dim=2)``. This kernel
fuses them: every input element is read once from global memory and only the pooled
[B, nW, d] result is written.

Op: kv [B, nW, L, d] (bf16, fp16 or fp32) and gate [B, nW, L, d] fp32 logits (empty slots are
-inf; a whole column of -inf is not expected and gives NaN, as the reference does) give
  pooled[b, w, c] = sum_l softmax_l(gate[b, w, :, c]) * kv[b, w, l, c]      (in kv's dtype).
The B*nW rows are independent.

Layout (contiguous inputs, row r = b*nW + w; L and d are compile-time constants):
  * each thread owns V consecutive channels (V*elem = 16 bytes of kv: 8 for 16-bit kv, 4 for
    fp32), so kv and gate loads are 128-bit and coalesced along d; TPR = d/V threads cover a row;
  * S thread groups ("slices") split the L slots of a row (S*TPR <= 256 threads); each slice runs
    an online softmax over its L/S slots in chunks of K slots (load K slots, one max and one
    rescale per chunk, then exp2 + FMA per slot);
  * with S > 1 the slices' (max, sum, acc) go through shared memory and slice 0 merges them;
  * small rows (TPR*S < 128) put several rows in one CTA.
Numerics: fp32 throughout (exp2 with log2(e) folded in, ex2.approx), one division at the end,
one rounding to kv's dtype. The running max starts at -FLT_MAX instead of -inf, so empty (-inf)
slots add exactly 0 and never produce inf-inf NaNs. The reference rounds the weights and the
products to kv's dtype before summing (``w.to(kv.dtype)``); the kernel does not, so for 16-bit kv
the two differ by about one output ulp (see docs/kernels.md for the tolerances).

Entry points:
  * ``compressor_pool_ref(kv, gate)``: the PyTorch reference (Compressor.pool's two lines);
  * ``compressor_pool_cute(kv, gate)``: the kernel (CUDA tensors; cute.compile once per
    (dtype, L, d, config), cached);
  * ``compressor_pool(kv, gate)``: the kernel when ``have_cute()`` and the inputs are CUDA and
    supported, else the reference;
  * ``compressor_pool_aot(kv, gate, aot_dir)`` / ``export_aot(...)``: cubins compiled ahead of
    time with the same kernel (``python -m dsv4lab.kernels.compressor_pool_cute export-aot DIR``, works
    without a GPU) and launched through cuda-python's driver API, for machines without
    nvidia-cutlass-dsl (see .cute/run_gpu.sh).

The kernel takes raw pointers (``cute.runtime.make_ptr`` with their alignment) and an Int32 row
count rather than ``from_dlpack`` tensors: no per-call DLPack conversion, a plain (u64, u64, u64,
u32) kernel ABI that the AOT launcher can call, and only the row count is dynamic. Rows are split
into launches so that element offsets fit the kernel's 32-bit index math.

Importing this module imports neither cutlass nor cuda-python and does no GPU work.
"""
# No `from __future__ import annotations`: CuTeDSL evaluates the kernel annotations, and the
# lazily imported cutlass names are not module globals.
import argparse
import ctypes
import functools
import json
import math
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .device import on_input_device

__all__ = [
    "compressor_pool_ref", "compressor_pool_cute", "compressor_pool", "have_cute",
    "supported", "PoolConfig", "make_config", "export_aot", "compressor_pool_aot",
]

_KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_LOG2E = 1.4426950408889634
_NEG_BIG = -3.4028234663852886e38  # -FLT_MAX: the running max's start (see module docstring)
_MAX_THREADS_PER_ROW = 256
_I32_MAX = 2**31 - 1


# ---------------------------------------------------------------------------- validation / ref
def _check(kv: torch.Tensor, gate: torch.Tensor) -> None:
    """ValueError unless kv [B,nW,L,d] (bf16/fp16/fp32) and gate (fp32, same shape/device)."""
    if not isinstance(kv, torch.Tensor) or not isinstance(gate, torch.Tensor):
        raise ValueError("kv and gate must be tensors")
    if kv.dim() != 4:
        raise ValueError(f"kv must be [B, nW, L, d], got shape {tuple(kv.shape)}")
    if gate.shape != kv.shape:
        raise ValueError(f"gate shape {tuple(gate.shape)} != kv shape {tuple(kv.shape)}")
    if kv.dtype not in _KV_DTYPES:
        raise ValueError(f"kv dtype must be one of {_KV_DTYPES}, got {kv.dtype}")
    if gate.dtype != torch.float32:
        raise ValueError(f"gate must be float32 logits, got {gate.dtype}")
    if kv.device != gate.device:
        raise ValueError(f"kv on {kv.device} but gate on {gate.device}")
    if kv.shape[2] == 0 or kv.shape[3] == 0:
        raise ValueError(f"need L >= 1 slots and d >= 1 channels, got shape {tuple(kv.shape)}")


def compressor_pool_ref(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: the softmax + weighted sum of ``Compressor.pool`` -> [B, nW, d] in kv's dtype."""
    _check(kv, gate)
    w = torch.softmax(gate, dim=2, dtype=torch.float32)
    return (kv * w.to(kv.dtype)).sum(dim=2)


# ---------------------------------------------------------------------------- availability
@functools.lru_cache(maxsize=None)
def _cutlass_importable() -> bool:
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception:
        return False
    return True


def have_cute() -> bool:
    """True only with a CUDA device and cutlass (nvidia-cutlass-dsl) importable;
    DSV4LAB_NO_KERNELS=1 forces False."""
    if os.environ.get("DSV4LAB_NO_KERNELS", "0") == "1":
        return False
    return torch.cuda.is_available() and _cutlass_importable()


def supported(kv: torch.Tensor, gate: torch.Tensor) -> bool:
    """Whether the kernel takes these (validated) inputs: CUDA tensors and d/V <= 256 threads per row."""
    if not (kv.is_cuda and gate.is_cuda):
        return False
    try:
        make_config(kv.dtype, kv.shape[2], kv.shape[3])
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------- config
@dataclass(frozen=True)
class PoolConfig:
    """Compile-time shape of one kernel instance (see module docstring for the meaning)."""
    dtype: str      # "bf16" | "fp16" | "fp32" (kv and output)
    L: int          # slots per row
    d: int          # channels
    vec: int        # channels per thread (V)
    tpr: int        # threads per row slice = d / V
    slices: int     # S: slot groups per row, each S*tpr <= max_threads
    chunk: int      # K: slots loaded per online-softmax step
    rpb: int        # rows per CTA
    max_threads: int

    @property
    def threads(self) -> int:
        return self.tpr * self.slices * self.rpb

    @property
    def smem_bytes(self) -> int:
        """Shared memory of the slice merge: 3 fp32 arrays [V, TPR, S, RPB] (0 when S == 1)."""
        return 0 if self.slices == 1 else 3 * 4 * self.vec * self.tpr * self.slices * self.rpb

    @property
    def key(self) -> str:
        return f"pool_{self.dtype}_L{self.L}_d{self.d}_S{self.slices}_K{self.chunk}_R{self.rpb}"


_DTYPE_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_NAME_DTYPE = {v: k for k, v in _DTYPE_NAME.items()}


def make_config(dtype: torch.dtype, L: int, d: int, max_threads: int = _MAX_THREADS_PER_ROW,
                chunk: int | None = None) -> PoolConfig:
    """Pick V, S, K and rows per CTA for (dtype, L, d). ValueError if the kernel can't take it."""
    if dtype not in _DTYPE_NAME:
        raise ValueError(f"unsupported kv dtype {dtype}")
    if L < 1 or d < 1:
        raise ValueError(f"bad L={L}, d={d}")
    esize = torch.empty((), dtype=dtype).element_size()
    vec = 16 // esize
    while d % vec:
        vec //= 2
    tpr = d // vec
    if tpr > max_threads:
        raise ValueError(f"d={d} needs {tpr} threads per row (> {max_threads})")
    slices = 1  # largest power of two dividing L, with >= 4 slots per slice and S*tpr <= max
    while slices * 2 * tpr <= max_threads and L % (slices * 2) == 0 and L // (slices * 2) >= 4:
        slices *= 2
    per_slice = L // slices
    k0 = chunk if chunk is not None else (4 if vec == 8 else 8)  # ~32 fp32 gate registers
    k = math.gcd(per_slice, k0)
    rpb = max(1, 128 // (tpr * slices))
    return PoolConfig(_DTYPE_NAME[dtype], L, d, vec, tpr, slices, k, rpb, max_threads)


# ---------------------------------------------------------------------------- the kernel
def _cutlass_dtype(name: str) -> Any:
    import cutlass  # lazy: optional dependency

    return {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}[name]


@functools.lru_cache(maxsize=None)
def _kernel_class() -> type:
    """Build the CuTeDSL kernel class (lazily: needs cutlass)."""
    import cuda.bindings.driver as cuda  # lazy: cutlass/cuda-python are optional (module import stays free of them)
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    class _Pool:
        """One compiled instance per PoolConfig; ``__call__`` is the host launcher."""

        def __init__(self, cfg: PoolConfig) -> None:
            self.cfg = cfg
            self.dt = _cutlass_dtype(cfg.dtype)

        @cute.jit
        def __call__(self, kv_ptr: cute.Pointer, g_ptr: cute.Pointer, o_ptr: cute.Pointer,
                     rows: Int32, stream: cuda.CUstream) -> None:
            cfg = self.cfg
            self.kernel(kv_ptr, g_ptr, o_ptr, rows).launch(
                grid=[cute.ceil_div(rows, cfg.rpb), 1, 1], block=[cfg.threads, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, kv_ptr: cute.Pointer, g_ptr: cute.Pointer, o_ptr: cute.Pointer,
                   rows: Int32) -> None:
            cfg = self.cfg
            V, TPR, S, K, RPB, L, d = cfg.vec, cfg.tpr, cfg.slices, cfg.chunk, cfg.rpb, cfg.L, cfg.d
            N = L // S
            # (channel-in-vector, vector, slot, row) views; only the row extent is dynamic.
            mKV = cute.make_tensor(kv_ptr, cute.make_layout((V, d // V, L, rows), stride=(1, V, d, L * d)))
            mG = cute.make_tensor(g_ptr, cute.make_layout((V, d // V, L, rows), stride=(1, V, d, L * d)))
            mO = cute.make_tensor(o_ptr, cute.make_layout((V, d // V, rows), stride=(1, V, d)))

            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            c = tidx % TPR               # which V-channel vector
            sl = (tidx // TPR) % S       # which slot slice
            rl = tidx // (TPR * S)       # which row of this CTA
            row = bidx * RPB + rl
            rowc = row                   # clamped row: tail threads compute but do not store
            if row >= rows:
                rowc = rows - 1

            m_r = cute.make_rmem_tensor(cute.make_layout(V), Float32)
            s_r = cute.make_rmem_tensor(cute.make_layout(V), Float32)
            a_r = cute.make_rmem_tensor(cute.make_layout(V), Float32)
            m_r.fill(_NEG_BIG)
            s_r.fill(0.0)
            a_r.fill(0.0)
            g_r = cute.make_rmem_tensor(cute.make_layout((V, K)), Float32)
            x_r = cute.make_rmem_tensor(cute.make_layout((V, K)), mKV.element_type)
            l0 = sl * N
            for ci in cutlass.range(N // K, unroll=1):
                for j in cutlass.range_constexpr(K):  # issue all K slots' loads first
                    slot = l0 + ci * K + j
                    cute.autovec_copy(mG[None, c, slot, rowc], g_r[None, j])
                    cute.autovec_copy(mKV[None, c, slot, rowc], x_r[None, j])
                m_old = m_r.load()
                for j in cutlass.range_constexpr(K):  # scalar max.ftz.f32 (the vector max is setp/selp)
                    for i in cutlass.range_constexpr(V):
                        m_r[i] = cute.math.max(m_r[i], g_r[i, j], ftz=True)
                m_new = m_r.load()
                alpha = cute.math.exp2((m_old - m_new) * _LOG2E, fastmath=True)
                ssum = s_r.load() * alpha
                acc = a_r.load() * alpha
                for j in cutlass.range_constexpr(K):
                    p = cute.math.exp2((g_r[None, j].load() - m_new) * _LOG2E, fastmath=True)
                    ssum = ssum + p
                    acc = acc + p * x_r[None, j].load().to(Float32)
                s_r.store(ssum)
                a_r.store(acc)

            o_r = cute.make_rmem_tensor(cute.make_layout(V), mO.element_type)
            if cutlass.const_expr(S == 1):
                o_r.store((a_r.load() / s_r.load()).to(mO.element_type))
                if row < rows:
                    cute.autovec_copy(o_r, mO[None, c, row])
            else:
                smem = cutlass.memory.SmemAllocator()
                lay = cute.make_layout((V, TPR, S, RPB))
                sm = smem.allocate_tensor(Float32, lay, byte_alignment=16)
                ss = smem.allocate_tensor(Float32, lay, byte_alignment=16)
                sa = smem.allocate_tensor(Float32, lay, byte_alignment=16)
                cute.autovec_copy(m_r, sm[None, c, sl, rl])
                cute.autovec_copy(s_r, ss[None, c, sl, rl])
                cute.autovec_copy(a_r, sa[None, c, sl, rl])
                cute.arch.barrier()
                if sl == 0:  # merge the slices: rescale each to the common max
                    m_own = m_r.load()
                    for j in cutlass.range_constexpr(1, S):
                        for i in cutlass.range_constexpr(V):
                            m_r[i] = cute.math.max(m_r[i], sm[i, c, j, rl], ftz=True)
                    mt = m_r.load()
                    f0 = cute.math.exp2((m_own - mt) * _LOG2E, fastmath=True)
                    ssum = s_r.load() * f0
                    acc = a_r.load() * f0
                    for j in cutlass.range_constexpr(1, S):
                        f = cute.math.exp2((sm[None, c, j, rl].load() - mt) * _LOG2E, fastmath=True)
                        ssum = ssum + ss[None, c, j, rl].load() * f
                        acc = acc + sa[None, c, j, rl].load() * f
                    o_r.store((acc / ssum).to(mO.element_type))
                    if row < rows:
                        cute.autovec_copy(o_r, mO[None, c, row])

    return _Pool


def _compile(cfg: PoolConfig, options: str | None = None) -> Any:
    """cute.compile one instance (no GPU needed when CUTE_DSL_ARCH is set)."""
    import cuda.bindings.driver as cuda  # lazy: cutlass/cuda-python are optional (module import stays free of them)
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    dt = _cutlass_dtype(cfg.dtype)
    esize = dt.width // 8
    args = (make_ptr(dt, 0, cute.AddressSpace.gmem, assumed_align=cfg.vec * esize),
            make_ptr(cutlass.Float32, 0, cute.AddressSpace.gmem, assumed_align=cfg.vec * 4),
            make_ptr(dt, 0, cute.AddressSpace.gmem, assumed_align=cfg.vec * esize),
            cutlass.Int32(1), cuda.CUstream(0))
    obj = _kernel_class()(cfg)
    if options:
        return cute.compile(obj, *args, options=options)
    return cute.compile(obj, *args)


@functools.lru_cache(maxsize=None)
def _compiled(cfg: PoolConfig) -> Any:
    return _compile(cfg)


def _prepare(kv: torch.Tensor, gate: torch.Tensor, cfg: PoolConfig):
    """Contiguous, suitably aligned inputs and the output buffer."""
    kv = kv.contiguous()
    gate = gate.contiguous()
    if kv.data_ptr() % (cfg.vec * kv.element_size()):
        kv = kv.clone()
    if gate.data_ptr() % (cfg.vec * 4):
        gate = gate.clone()
    out = torch.empty(kv.shape[:2] + kv.shape[3:], dtype=kv.dtype, device=kv.device)
    return kv, gate, out


def _row_chunks(rows: int, L: int, d: int):
    """Row ranges whose element offsets fit the kernel's 32-bit index math."""
    step = max(1, _I32_MAX // (L * d))
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


def _pick(kv: torch.Tensor, config: PoolConfig | None) -> PoolConfig:
    L, d = kv.shape[2], kv.shape[3]
    cfg = config or make_config(kv.dtype, L, d)
    if (cfg.dtype, cfg.L, cfg.d) != (_DTYPE_NAME[kv.dtype], L, d):
        raise ValueError(f"config {cfg.key} does not match kv {kv.dtype} L={L} d={d}")
    return cfg


@on_input_device
def compressor_pool_cute(kv: torch.Tensor, gate: torch.Tensor, config: PoolConfig | None = None) -> torch.Tensor:
    """The CuTeDSL kernel (CUDA tensors, nvidia-cutlass-dsl installed) -> [B, nW, d] in kv's dtype."""
    _check(kv, gate)
    if not (kv.is_cuda and gate.is_cuda):
        raise ValueError("compressor_pool_cute needs CUDA tensors")
    cfg = _pick(kv, config)
    import cuda.bindings.driver as cuda  # lazy: cutlass/cuda-python are optional (module import stays free of them)
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    kv, gate, out = _prepare(kv, gate, cfg)
    rows = kv.shape[0] * kv.shape[1]
    if rows == 0:
        return out
    with torch.cuda.device(kv.device):
        fn = _compiled(cfg)
        stream = cuda.CUstream(torch.cuda.current_stream(kv.device).cuda_stream)
        dt = _cutlass_dtype(cfg.dtype)
        esize = kv.element_size()
        row_kv, row_out = cfg.L * cfg.d * esize, cfg.d * esize
        for r0, r1 in _row_chunks(rows, cfg.L, cfg.d):
            fn(make_ptr(dt, kv.data_ptr() + r0 * row_kv, cute.AddressSpace.gmem, assumed_align=cfg.vec * esize),
               make_ptr(cutlass.Float32, gate.data_ptr() + r0 * cfg.L * cfg.d * 4, cute.AddressSpace.gmem,
                        assumed_align=cfg.vec * 4),
               make_ptr(dt, out.data_ptr() + r0 * row_out, cute.AddressSpace.gmem, assumed_align=cfg.vec * esize),
               cutlass.Int32(r1 - r0), stream)
    return out


def compressor_pool(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Softmax-pool: the CuTeDSL kernel on CUDA with cutlass importable, the reference elsewhere."""
    _check(kv, gate)
    if have_cute() and supported(kv, gate):
        return compressor_pool_cute(kv, gate)
    return compressor_pool_ref(kv, gate)


# ---------------------------------------------------------------------------- ahead of time
_AOT_ARCH = "sm_90a"


def _entry_params(ptx: str) -> tuple[str, list[str]]:
    """The kernel entry's name and parameter types from the PTX text."""
    m = re.search(r"\.entry\s+(\S+)\s*\((.*?)\)", ptx, re.S)
    if not m:
        raise RuntimeError("no .entry in the PTX")
    params = [re.match(r"\s*\.param\s+(?:\.align\s+\d+\s+)?\.(\w+)", p).group(1)
              for p in m.group(2).split(",") if p.strip()]
    return m.group(1), params


def _compile_kept(cfg: PoolConfig, arch: str) -> tuple[bytes, str]:
    """cute.compile for ``arch`` keeping the cubin and PTX. Both are explicit compile options
    (``--gpu-arch``, ``--dump-dir``): CUTE_DSL_ARCH / CUTE_DSL_DUMP_DIR are read once, when the DSL
    starts, so setting them here would be too late if cutlass is already imported."""

    with tempfile.TemporaryDirectory(prefix="cute_pool_keep_") as tmp:
        fn = _compile(cfg, options=f"--keep-cubin --keep-ptx --gpu-arch {arch} --dump-dir {tmp}")
        cubin, ptx = fn.__cubin__, fn.__ptx__
        if isinstance(cubin, str) and os.path.exists(cubin):
            cubin = Path(cubin).read_bytes()
        if isinstance(ptx, str) and ".entry" not in ptx and os.path.exists(ptx):
            ptx = Path(ptx).read_text()
    if not isinstance(cubin, bytes) or not isinstance(ptx, str) or ".entry" not in ptx:
        raise RuntimeError(f"{cfg.key}: cute.compile kept no cubin/PTX")
    target = re.search(r"^\.target\s+(\S+)", ptx, re.M)
    if not target or target.group(1) != arch:
        raise RuntimeError(f"{cfg.key}: compiled for {target and target.group(1)}, not {arch}")
    return cubin, ptx


def export_aot(out_dir: str | Path, specs: list[tuple[torch.dtype, int, int]], arch: str = _AOT_ARCH) -> list[dict]:
    """Compile each (dtype, L, d) with cute.compile for ``arch`` (no GPU needed) and write
    ``<key>.cubin`` + ``manifest.json`` (entry name, launch shape, parameter ABI) to out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for dtype, L, d in specs:
        cfg = make_config(dtype, L, d)
        cubin, ptx = _compile_kept(cfg, arch)
        name, params = _entry_params(ptx)
        if params != ["u64", "u64", "u64", "u32"]:
            raise RuntimeError(f"{cfg.key}: unexpected kernel ABI {params}")
        ntid = re.search(r"\.reqntid\s+(\d+)", ptx)
        if not ntid or int(ntid.group(1)) != cfg.threads:
            raise RuntimeError(f"{cfg.key}: PTX block size {ntid and ntid.group(1)} != {cfg.threads}")
        (out / f"{cfg.key}.cubin").write_bytes(cubin)
        entries.append({**asdict(cfg), "key": cfg.key, "threads": cfg.threads, "smem": cfg.smem_bytes,
                        "entry": name, "params": params, "arch": arch})
    (out / "manifest.json").write_text(json.dumps(entries, indent=1))
    return entries


class _AotLauncher:
    """A cubin from ``export_aot`` launched with cuda-python's driver API (no cutlass needed).
    Uses the context torch made current (its primary context), retaining it if none is current."""

    def __init__(self, aot_dir: Path, entry: dict, device: torch.device) -> None:

        from cuda.bindings import driver as cu  # lazy: optional dependency

        self.cu, self.entry = cu, entry
        with torch.cuda.device(device):
            torch.cuda.synchronize(device)  # creates torch's primary context if needed
            err, ctx = cu.cuCtxGetCurrent()
            if self._code(err) or ctx is None or int(ctx) == 0:
                dev = self._ok(cu.cuDeviceGet(device.index or 0))
                self._ok(cu.cuCtxSetCurrent(self._ok(cu.cuDevicePrimaryCtxRetain(dev))))
            buf = ctypes.create_string_buffer((aot_dir / f"{entry['key']}.cubin").read_bytes())
            self.module = self._ok(cu.cuModuleLoadData(ctypes.addressof(buf)))
            self.func = self._ok(cu.cuModuleGetFunction(self.module, entry["entry"].encode()))

    @staticmethod
    def _code(err: Any) -> int:
        return int(getattr(err, "value", err))

    def _ok(self, result: Any) -> Any:
        """(CUresult, value...) -> value; RuntimeError on a CUDA error."""
        err, *rest = result if isinstance(result, tuple) else (result,)
        if self._code(err):
            raise RuntimeError(f"CUDA driver error {err!r} in the AOT pool kernel {self.entry['key']}")
        return rest[0] if len(rest) == 1 else None

    def __call__(self, kv_ptr: int, g_ptr: int, o_ptr: int, rows: int, stream: int) -> None:

        e, cu = self.entry, self.cu
        grid = (rows + e["rpb"] - 1) // e["rpb"]
        args = (ctypes.c_uint64(kv_ptr), ctypes.c_uint64(g_ptr), ctypes.c_uint64(o_ptr), ctypes.c_int32(rows))
        ptrs = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        self._ok(cu.cuLaunchKernel(self.func, grid, 1, 1, e["threads"], 1, 1, e["smem"],
                                   cu.CUstream(stream), ctypes.addressof(ptrs), 0))


@functools.lru_cache(maxsize=None)
def _aot_manifest(aot_dir: str) -> dict[tuple[str, int, int], dict]:
    entries = json.loads((Path(aot_dir) / "manifest.json").read_text())
    return {(e["dtype"], e["L"], e["d"]): e for e in entries}


@functools.lru_cache(maxsize=None)
def _aot_launcher(aot_dir: str, key: tuple[str, int, int], device: torch.device) -> _AotLauncher:
    return _AotLauncher(Path(aot_dir), _aot_manifest(aot_dir)[key], device)


def aot_has(aot_dir: str | Path, dtype: torch.dtype, L: int, d: int) -> bool:
    """Whether ``export_aot`` wrote a cubin for (dtype, L, d) into aot_dir."""
    p = Path(aot_dir) / "manifest.json"
    return p.exists() and (_DTYPE_NAME.get(dtype), L, d) in _aot_manifest(str(aot_dir))


@on_input_device
def compressor_pool_aot(kv: torch.Tensor, gate: torch.Tensor, aot_dir: str | Path) -> torch.Tensor:
    """The same kernel from a precompiled cubin (see export_aot); CUDA tensors only."""
    _check(kv, gate)
    if not (kv.is_cuda and gate.is_cuda):
        raise ValueError("compressor_pool_aot needs CUDA tensors")
    key = (_DTYPE_NAME[kv.dtype], kv.shape[2], kv.shape[3])
    entry = _aot_manifest(str(aot_dir)).get(key)
    if entry is None:
        raise ValueError(f"no precompiled kernel for {key} in {aot_dir}")
    cfg = PoolConfig(**{f: entry[f] for f in PoolConfig.__dataclass_fields__})
    kv, gate, out = _prepare(kv, gate, cfg)
    rows = kv.shape[0] * kv.shape[1]
    if rows == 0:
        return out
    launch = _aot_launcher(str(aot_dir), key, kv.device)
    stream = torch.cuda.current_stream(kv.device).cuda_stream
    esize = kv.element_size()
    with torch.cuda.device(kv.device):
        for r0, r1 in _row_chunks(rows, cfg.L, cfg.d):
            launch(kv.data_ptr() + r0 * cfg.L * cfg.d * esize, gate.data_ptr() + r0 * cfg.L * cfg.d * 4,
                   out.data_ptr() + r0 * cfg.d * esize, r1 - r0, stream)
    return out


# Shapes the GPU tests and the benchmark use (export-aot's default list).
AOT_SPECS: list[tuple[torch.dtype, int, int]] = [
    (dt, L, d) for dt in (torch.bfloat16, torch.float32)
    for L, d in ((8, 512), (128, 512), (4, 128), (16, 1024))
]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export-aot", help="compile the kernel for AOT_SPECS into DIR (no GPU needed)")
    ex.add_argument("dir")
    ex.add_argument("--arch", default=_AOT_ARCH)
    args = ap.parse_args(argv)
    if args.cmd == "export-aot":
        for e in export_aot(args.dir, AOT_SPECS, args.arch):
            print(e["key"], e["threads"], "threads", e["smem"], "B smem", e["arch"])


if __name__ == "__main__":  # run the package's copy so kernel names match the JIT ones
    from dsv4lab.kernels.compressor_pool_cute import main as _pkg_main

    _pkg_main()
