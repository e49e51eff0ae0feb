"""HookPoint (dsv4lab/model/hooks.py): an identity tap whose forward hooks see and may replace the
tensor; ``active`` says whether any hook would read it. (Hook schema, caches and interventions on
the whole model are tests/test_hooks.py.)"""
from __future__ import annotations

import torch

from dsv4lab.model.hooks import HookPoint


def test_identity_active_and_replacement():
    hp = HookPoint("a tap")
    x = torch.randn(3, 4)
    assert hp(x) is x and not hp.active and hp.meaning == "a tap"
    seen = []
    h = hp.register_forward_hook(lambda mod, inp, out: seen.append(out))
    assert hp.active and hp(x) is x and seen == [x]
    h.remove()
    assert not hp.active
    h = hp.register_forward_hook(lambda mod, inp, out: out * 0)
    assert torch.equal(hp(x), torch.zeros_like(x))
    h.remove()
    h = hp.register_forward_pre_hook(lambda mod, inp: None)
    assert hp.active
    h.remove()
