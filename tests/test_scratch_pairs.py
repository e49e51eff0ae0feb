"""Kept kernel buffers (``host.scratch``) and the x-pairs prelude writing into them. On CPU with a
stand-in for the prelude kernel that records its launches and writes a marker, so what is launched
and returned can be asserted; the real kernel's bits are checked by the interpreter suites, and the
GPU suites run the model on the kept buffers."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from dsv4lab.kernels import activation_pairs, host  # noqa: E402


class _Prelude:
    """Stands in for ``_x_pairs_kernel``: ``kernel[grid](x, xp, inv, KG, KGP, **kw)`` records x and
    writes x's first element into every pair word (so a stale buffer is visible)."""

    def __init__(self):
        self.launched: list = []

    def __getitem__(self, grid):
        def run(x, xp, inv, KG, KGP, **kw):
            self.launched.append(x)
            xp.fill_(int(x.flatten()[0].item()))
            inv.fill_(1.0)
        return run


@pytest.fixture
def prelude(monkeypatch):
    stub = _Prelude()
    monkeypatch.setattr(activation_pairs, "_x_pairs_kernel", stub)
    return stub


def test_scratch_is_kept_per_tag_shape_dtype_and_large_requests_are_fresh():
    a = host.scratch("t", (4, 16), torch.int32, torch.device("cpu"))
    assert host.scratch("t", (4, 16), torch.int32, torch.device("cpu")) is a
    assert host.scratch("u", (4, 16), torch.int32, torch.device("cpu")) is not a
    assert host.scratch("t", (4, 16), torch.float32, torch.device("cpu")) is not a
    assert host.scratch("t", (5, 16), torch.int32, torch.device("cpu")) is not a
    big = (host.SCRATCH_MAX_ELEMS + 1,)
    assert host.scratch("t", big, torch.int8, torch.device("cpu")) is not host.scratch("t", big, torch.int8,
                                                                                          torch.device("cpu"))


def test_pairs_live_in_kept_buffers_and_are_made_on_every_call(prelude):
    """The same buffers come back for one size (no allocation a call), and every call launches: a
    kept buffer rewritten by a kernel (the MoE's SwiGLU rows) has the same address and version on
    the next token, so skipping a launch on those would serve stale pairs."""
    x = torch.full((1, 64), 3.0)
    xp1, inv1 = activation_pairs.x_pairs(x)
    h = host.scratch("rows", (1, 64), torch.float32, torch.device("cpu"))
    h.fill_(5.0)
    xp2, inv2 = activation_pairs.x_pairs(h)
    h.view(torch.int32).copy_(torch.full((1, 64), 7.0).view(torch.int32))  # as a kernel would: version bumped
    xp3, _ = activation_pairs.x_pairs(h)
    xp4, _ = activation_pairs.x_pairs(x)
    assert xp1 is xp2 is xp3 is xp4 and inv1 is inv2
    assert len(prelude.launched) == 4 and int(xp4[0, 0]) == 3
    z = torch.full((1, 32), 5.0)
    zp, _ = activation_pairs.x_pairs(z)
    assert zp.shape == (2, 16) and zp is not xp1 and int(zp[0, 0]) == 5 and int(xp1[0, 0]) == 3


def test_pairs_written_by_a_kernel_are_used_until_x_or_the_buffers_change(prelude):
    """An emitting kernel (the decode RMSNorm) records that the kept buffers hold its output's
    pairs: x_pairs of that output, or of a view of all of it, launches nothing; a version bump on
    x, another row's pairs in the same buffers, or a part of x launches again; other sizes keep
    their own record."""
    dev = torch.device("cpu")
    y = torch.full((1, 1, 64), 2.0)
    xp, inv = activation_pairs.pairs_buffers(4, dev)
    activation_pairs.pairs_written(4, dev, y)
    assert activation_pairs.x_pairs(y) == (xp, inv) and activation_pairs.x_pairs(y.view(1, 64))[0] is xp
    assert prelude.launched == []
    activation_pairs.pairs_written(2, dev, torch.zeros(32))  # another size: its own buffers
    activation_pairs.x_pairs(y)
    assert prelude.launched == []
    activation_pairs.x_pairs(y[..., :32])                 # a part of y: not its pairs
    assert len(prelude.launched) == 1
    activation_pairs.x_pairs(y)                           # the 2-group launch left y's record alone
    assert len(prelude.launched) == 1
    z = torch.full((1, 64), 9.0)
    activation_pairs.x_pairs(z)                           # another row of 4 groups: the buffers now hold z's
    activation_pairs.x_pairs(y)
    assert len(prelude.launched) == 3 and int(xp[0, 0]) == 2
    activation_pairs.pairs_written(4, dev, y)
    y.add_(1)                                             # changed in place: version bumped
    activation_pairs.x_pairs(y)
    assert len(prelude.launched) == 4 and int(xp[0, 0]) == 3
