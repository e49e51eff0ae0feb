"""Shared test fixtures."""
from __future__ import annotations

import os

import pytest
import torch

# dsv4lab.kernels.host pins Triton's FP fusion on when it is first imported (a process-wide
# setting its kernels were checked with); pinned here before any test runs, so no test looks as if
# it had changed it (no_leaked_switches). tests/test_triton_options.py checks the pin itself in a
# fresh process without it.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threading only adds contention on a loaded 2-core box
    (index_add_ is pathological under load), so these modules run single-threaded."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session", autouse=True)
def reference_cache_dir(tmp_path_factory):
    """Reference runs cached by the triage flows go to a temporary directory, not the user's
    cache (dsv4lab.precision.reference_cache reads DSV4LAB_CACHE; notebooks inherit it)."""
    old = os.environ.get("DSV4LAB_CACHE")
    os.environ["DSV4LAB_CACHE"] = str(tmp_path_factory.mktemp("dsv4lab-cache"))
    yield os.environ["DSV4LAB_CACHE"]
    if old is None:
        os.environ.pop("DSV4LAB_CACHE", None)
    else:
        os.environ["DSV4LAB_CACHE"] = old


def _dsv4lab_env() -> dict:
    return {k: v for k, v in os.environ.items() if k.startswith(("DSV4LAB_", "TRITON_"))}


@pytest.fixture(autouse=True)
def no_leaked_switches():
    """A test that sets a DSV4LAB_* / TRITON_* switch in os.environ (not monkeypatch) leaks it into
    every later test and every subprocess they start: DSV4LAB_KERNEL_VERIFY=0 once turned off the
    first-use guard that tests/kernels_interp_check.py checks, far from the test that set it."""
    before = _dsv4lab_env()
    yield
    after = _dsv4lab_env()
    if after != before:
        changed = sorted(set(before.items()) ^ set(after.items()))
        os.environ.update(before)
        for k in set(after) - set(before):
            os.environ.pop(k, None)
        pytest.fail(f"the test changed environment switches {changed}; use monkeypatch.setenv")
