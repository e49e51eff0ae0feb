"""Run a Triton interpreter check script (tests/*_interp_check.py) in a subprocess: the
interpreter must be switched on (TRITON_INTERPRET=1) before triton is imported, which this test
process has already done. Each script prints one line ``RESULT{json}``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dsv4lab.kernels.device import triton_importable

ROOT = Path(__file__).resolve().parents[1]


def interp_results(script: str, timeout: int = 600) -> dict:
    """The RESULT dict of ``tests/<script>`` run under TRITON_INTERPRET=1 (fails with its stderr)."""
    assert triton_importable(), "triton is part of the test set-up (pip install -e '.[kernels]'); the interpreter tests need it"
    r = subprocess.run([sys.executable, str(ROOT / "tests" / script)], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-4000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])
