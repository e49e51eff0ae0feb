"""Every benchmark script imports and parses its arguments on a CPU box (the timing itself needs
the device machine): a renamed module or a broken import fails here, not during a device lease."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# scripts have a main guard; the shared helpers (measure.py) are only imported
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if 'if __name__ == "__main__"' in p.read_text())


def test_there_are_benchmarks():
    assert {"kernels.py", "m1_sweep.py", "gemv_anatomy.py", "decode.py"} <= {p.name for p in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_help(script: Path):
    r = subprocess.run([sys.executable, str(script), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("usage:"), r.stdout[:200]


@pytest.mark.parametrize("fmt", ["nvfp4", "official"])
def test_decode_benchmark_cpu_smoke(fmt: str):
    """The V4-Pro layer builder of benchmarks/decode.py (shrunk) decodes one finite step on CPU in
    both weight layouts: NVFP4 everywhere, or the official MXFP4 experts + FP8-block linears (the
    experts stack and gather, no masked loop)."""
    r = subprocess.run([sys.executable, "benchmarks/decode.py", "--cpu-smoke", "--format", fmt], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln.split() for ln in r.stdout.splitlines() if ln.endswith(tuple("0123456789"))]
    assert [ln[0] for ln in lines] == ["compressed_sparse_attention", "heavily_compressed_attention"], r.stdout
    assert all(ln[-2] == "True" and int(ln[-1]) > 0 for ln in lines), r.stdout  # finite output, active bytes


@pytest.mark.parametrize("fmt", ["nvfp4", "official"])
def test_full_model_benchmark_cpu_smoke(fmt: str):
    """benchmarks/full_model.py builds its random-weight model (no disk) and runs prefill + one
    eager decode step, finite, on a tiny config on the CPU; the timing itself needs the GPU."""
    r = subprocess.run([sys.executable, "benchmarks/full_model.py", "--cpu-smoke", "--format", fmt], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert res["prefill_finite"] and res["decode_finite"] and res["active_weight_bytes_per_token"] > 0, res


def test_prefill_benchmark_cpu_smoke():
    """benchmarks/prefill.py on a shrunken V4-Pro layer (CPU, 256 tokens in 64-token chunks): the
    dense and the bounded attention paths both run what they say, finite, and agree on the last
    chunk to bf16 rounding."""
    r = subprocess.run([sys.executable, "benchmarks/prefill.py", "--cpu-smoke"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)["results"]
    assert [x["layer"] for x in res] == ["csa", "hca"]
    for x in res:
        assert x["dense"]["ran"] == "dense" and x["bounded"]["ran"] == x["bounded_ref"]["ran"] == "bounded", x
        assert all(x[p]["out_finite"] and x[p]["tokens_per_s"] > 0 for p in ("dense", "bounded", "bounded_ref"))
        for p in ("bounded", "bounded_ref"):
            assert x[f"last_chunk_max_abs_diff_{p}_vs_dense"] <= 0.02 * x["last_chunk_max_abs"], x


def test_gemm_benchmark_cpu_smoke():
    """benchmarks/gemm.py on tiny shapes through Triton's interpreter: every format's prefill GEMM
    (and the old path it is compared with) and the grouped MoE prefill run and agree with the
    reference (the timing itself needs the GPU)."""
    r = subprocess.run([sys.executable, "benchmarks/gemm.py", "--cpu-smoke"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT"))[6:])
    assert {(x["format"], x["M"]) for x in res["gemm"]} == {(f, m) for f in ("nvfp4", "mxfp4", "fp8_block")
                                                             for m in (64, 130)}
    assert all(x["max_err_over_max_ref"] <= 1e-2 for x in res["gemm"]), res["gemm"]
    assert [x["moe_prefill"] for x in res["moe_prefill"]] == ["nvfp4", "mxfp4"]
    assert all(x["max_err_over_max_ref"] <= 2e-2 for x in res["moe_prefill"]), res["moe_prefill"]
