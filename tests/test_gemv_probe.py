"""benchmarks/gemv_probe.py: what the batch-1 f16x2 loop decodes, for every E2M1 code at every
element position of a word, against the reference decode (interpreter on CPU, inline PTX on GPU)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = {"exact": True, "pairs_covered": 256, "nonzero": 3584}


def test_interp_decode_probe():
    """The M == 1 loop's byte-code decode (its plain-Triton emulation) gives exactly the reference
    E2M1 value for every code at every element position of a word."""
    assert importlib.util.find_spec("triton") is not None, "triton is part of the test set-up"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gemv_probe.py")], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == EXPECTED


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_decode_probe():
    """The inline PTX of the M == 1 loop (shifts, masks, prmt, fma.rn.f16x2) decodes every code
    at every element position exactly like the reference."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.gemv_probe import decode_probe_selfcheck

    assert decode_probe_selfcheck("cuda") == EXPECTED
