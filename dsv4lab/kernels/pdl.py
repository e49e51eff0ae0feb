"""Programmatic dependent launch (PDL) of the one-wave decode kernels, both sides of it: the
rule (``use_pdl``: CUDA sm_90+, grids of at most one wave, not under the interpreter, not with
``DSV4LAB_PDL=0``), a launch site's keywords for the choice (``pdl_kw``) and the kernel's first
statement (``pdl_enter``). One module, so the rule and what it switches cannot drift apart.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .host import INTERPRET, device_capability, num_sms


PDL_ON = os.environ.get("DSV4LAB_PDL", "1") != "0"   # read once: A/B runs set it per process
_PDL_SMS: dict = {}  # device -> SM count where PDL applies (Hopper and newer), 0 where it does not


def pdl_kw(pdl: bool) -> dict:
    """A launch site's keywords for the choice: the kernel's ``PDL`` constexpr, and Triton's
    ``launch_pdl`` option where it is on (passed only then: off is Triton's default)."""
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}


def use_pdl(programs: int, device: torch.device) -> bool:
    """Launch a decode kernel of ``programs`` CTAs with PDL (``pdl_enter`` + ``launch_pdl``)? On
    CUDA sm_90+ for grids of at most one wave: CTAs that the next grid makes resident early wait in
    ``griddepcontrol.wait`` and hold SM slots, which a multi-wave grid's later CTAs would need."""
    sms = _PDL_SMS.get(device)
    if sms is None:
        ok = PDL_ON and not INTERPRET and device.type == "cuda" and device_capability(device)[0] >= 9
        sms = _PDL_SMS[device] = num_sms(device) if ok else 0
    return programs <= sms


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of a kernel that may be launched with programmatic dependent launch (PDL):
    wait until the previous grid on the stream has finished and its writes are visible, then let
    the next grid's CTAs become resident (they wait the same way). Nothing else precedes it, so
    every global read and write of the kernel stays ordered after the previous kernel, as without
    PDL; what is gained is the next launch's latency, hidden under this kernel's run. Without
    ``PDL`` (the interpreter, multi-wave grids, ``DSV4LAB_PDL=0``) it compiles to nothing."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
