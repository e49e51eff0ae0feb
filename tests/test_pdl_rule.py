"""Which decode launches use programmatic dependent launch (``pdl.use_pdl``): CUDA sm_90+ grids of
at most one wave, nothing on the CPU or under the interpreter, nothing with ``DSV4LAB_PDL=0``. On
the H200 (``-m gpu``) every decode entry point gives bitwise the same outputs with PDL as without."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from dsv4lab.kernels import pdl  # noqa: E402


@pytest.fixture
def fresh_rule(monkeypatch):
    monkeypatch.setattr(pdl, "_PDL_SMS", {})
    return pdl


def test_no_pdl_on_the_cpu(fresh_rule):
    assert not fresh_rule.use_pdl(1, torch.device("cpu"))


def test_one_wave_on_hopper_and_not_beyond(fresh_rule, monkeypatch):
    monkeypatch.setattr(fresh_rule, "INTERPRET", False)
    monkeypatch.setattr(fresh_rule, "PDL_ON", True)
    monkeypatch.setattr(fresh_rule, "device_capability", lambda d: (9, 0))
    monkeypatch.setattr(fresh_rule, "num_sms", lambda d: 132)
    dev = torch.device("cuda", 0)
    assert fresh_rule.use_pdl(1, dev) and fresh_rule.use_pdl(132, dev)
    assert not fresh_rule.use_pdl(133, dev)


@pytest.mark.parametrize("why", ["ampere", "switched off", "interpreter"])
def test_no_pdl_where_it_does_not_apply(fresh_rule, monkeypatch, why):
    monkeypatch.setattr(fresh_rule, "INTERPRET", why == "interpreter")
    monkeypatch.setattr(fresh_rule, "PDL_ON", why != "switched off")
    monkeypatch.setattr(fresh_rule, "device_capability", lambda d: (8, 0) if why == "ampere" else (9, 0))
    monkeypatch.setattr(fresh_rule, "num_sms", lambda d: 132)
    assert not fresh_rule.use_pdl(1, torch.device("cuda", 0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the device machine)")
def test_gpu_pdl_launches_match_plain_launches_bitwise(monkeypatch):
    """Each stateless decode entry point at V4-Pro shapes (``host_overhead.decode_calls``): outputs with
    the PDL rule on (the default) equal, bit for bit, those with it off (every launch plain)."""
    from test_direct_launch import _STATEFUL, _bitwise, _outputs
    from test_host_overhead import _host_overhead

    monkeypatch.setenv("DSV4LAB_KERNEL_VERIFY", "0")
    calls = _host_overhead().decode_calls(torch.bfloat16, "cuda")
    assert pdl.use_pdl(1, torch.device("cuda", torch.cuda.current_device())), "PDL must apply on the H200"
    for name, fn in calls.items():
        if name in _STATEFUL:
            continue
        fn()
        with_pdl = _outputs(fn())
        monkeypatch.setattr(pdl, "_PDL_SMS", {})
        monkeypatch.setattr(pdl, "PDL_ON", False)
        try:
            fn()
            plain = _outputs(fn())
        finally:
            monkeypatch.setattr(pdl, "PDL_ON", True)
            monkeypatch.setattr(pdl, "_PDL_SMS", {})
        torch.cuda.synchronize()
        _bitwise(with_pdl, plain, name)


def test_site_keywords_follow_the_choice():
    """On: the kernel's constexpr and Triton's launch option; off: the constexpr alone (Triton's default)."""
    assert pdl.pdl_kw(True) == {"PDL": True, "launch_pdl": True}
    assert pdl.pdl_kw(False) == {"PDL": False}
