"""Triton options the kernels were checked and timed with stay pinned across Triton versions:
FP fusion (FMA contraction) is on unless the user says otherwise (triton 3.9 warns that 3.10 turns
its default off; kernels needing separate roundings pass ``enable_fp_fusion=False`` themselves)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]
# what a launch without enable_fp_fusion gets (triton >= 3.9 asks fp_fusion_enabled, warning when unset)
PROBE = ("import warnings; warnings.simplefilter('error'); import dsv4lab.kernels.host, triton; "
         "k = triton.knobs.language; "
         "print(k.fp_fusion_enabled(None) if hasattr(k, 'fp_fusion_enabled') else k.default_fp_fusion)")


@pytest.mark.parametrize("user,expected", [(None, "True"), ("0", "False")])
def test_fp_fusion_default_pinned_unless_user_set(user, expected):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_DEFAULT_FP_FUSION"}
    if user is not None:
        env["TRITON_DEFAULT_FP_FUSION"] = user
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == expected
