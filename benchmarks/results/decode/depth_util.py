"""What the decode probes beside this file share: the code under test taken from ROOT (a tree such as
``.`` or ``.base``), the full-depth V4-Pro-shaped model (8 experts, one GPU) after a prefill, and one
V4-Pro layer decoding on the CPU stub (launches recorded, not run)."""
from __future__ import annotations

import contextlib
import os
import sys
from unittest import mock


def use_root(argv: list[str]) -> str:
    """ROOT (argv[1], default ``.``) first on sys.path, so dsv4lab and the benchmarks come from it."""
    root = argv[1] if len(argv) > 1 else "."
    sys.path.insert(0, root)
    sys.path.insert(0, root + "/benchmarks")
    return root


def full_depth(state_len: int, prompt: int = 256):
    """(model, state, step ids) of the 61-layer V4-Pro shape, kernels installed, experts stacked,
    ``prompt`` tokens prefilled and three eager decode steps run (the first launches build plans)."""
    import torch
    import full_model as fm
    from dsv4lab.checkpoint.synth import preset_config

    cfg = preset_config("v4-pro", experts=8)
    dev = torch.device("cuda", 0)
    _, devices = fm.plan_placement(cfg, "nvfp4", 1, 600, "141GB", fm.DEFAULT_RESERVE, [dev])
    model = fm.build(cfg, "nvfp4", devices, 0)
    fm.install_kernels_for_load(model, "auto", devices)
    fm.stack_experts(model)
    state = model.new_state(1, state_len)
    ids = torch.randint(0, cfg.vocab_size, (1, prompt), device=dev)
    model.prefill(ids, state, chunk=prompt, last_only=True)
    step_ids = torch.zeros(1, 1, dtype=torch.long, device=dev)
    for _ in range(3):
        model.decode_step(step_ids, state)
    torch.cuda.synchronize()
    return model, state, step_ids


@contextlib.contextmanager
def stub_layer(key: str, log: list | None = None):
    """A V4-Pro ``key`` layer ("csa" / "hca", 8 experts) on the CPU with its kernels installed and
    every launch stubbed (recorded into ``log``); yields ``step()``, one decode of it."""
    import torch
    import torch.nn.functional as F
    import host_overhead
    import launch_inventory as inventory
    from dsv4lab.kernels.install import install_kernels
    from dsv4lab.model.state import DecodeState

    dev = torch.device("cpu")
    layer, cfg, _ = inventory.build(inventory.LAYERS[key], dev, 8)
    st = DecodeState.allocate(cfg, 1, 4096, torch.bfloat16, dev)
    h = torch.randn(1, 1, cfg.hc_mult, cfg.hidden_size, dtype=torch.bfloat16)
    ids = torch.zeros(1, 1, dtype=torch.long)
    pos = st.pos_on(dev)
    pos.fill_(1000)
    with contextlib.ExitStack() as s:
        s.enter_context(torch.no_grad())
        s.enter_context(mock.patch.dict(os.environ, {"DSV4LAB_KERNEL_VERIFY": "0"}))
        s.enter_context(host_overhead.stubbed_launches(log))
        s.enter_context(inventory._cpu_install_allowed())
        s.enter_context(mock.patch.object(F, "linear", lambda x, w, b=None: x.new_empty(*x.shape[:-1], w.shape[0])))
        install_kernels(layer)
        for m in layer.modules():
            if hasattr(m, "kernel_devices"):
                m.kernel_devices = ("cuda", "cpu")
        yield lambda: layer.decode(h, ids, pos, st.layers[0])
