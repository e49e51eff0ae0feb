"""Helpers to build random tiny configs and the transformers oracle for parity tests, and to run a
model as prefill then token-by-token decode."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from dsv4lab.config import DSV4Config, config_from_dict
from dsv4lab.kernels.device import triton_importable


def tiny_config(**over) -> DSV4Config:
    d = dict(vocab_size=97, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4,
             num_attention_heads=4, head_dim=16, partial_rotary_factor=0.5, q_lora_rank=16,
             num_experts_per_tok=2, n_routed_experts=4, o_groups=2, o_lora_rank=8, index_n_heads=8,
             index_head_dim=16, index_topk=3, sliding_window=8,
             layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                          "compressed_sparse_attention"],
             compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
             mlp_layer_types=["hash_moe", "moe", "moe", "moe"], hc_sinkhorn_iters=5, swiglu_limit=1.0,
             routed_scaling_factor=1.5)
    d.update(over)
    return config_from_dict(d)


def random_ids(cfg: DSV4Config, n: int = 96, b: int = 2, seed: int = 7) -> torch.Tensor:
    """Token ids [b, n] in 2..vocab-1 (seeded)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, cfg.vocab_size, (b, n), generator=g)


def oracle(cfg: DSV4Config, seed: int = 0):
    """A transformers DeepseekV4ForCausalLM with random (non-trivial) weights."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    hf_cfg = DeepseekV4Config(**{k: v for k, v in cfg.to_transformers_dict().items() if k not in ("architectures", "model_type")})
    hf_cfg._attn_implementation = "eager"
    m = DeepseekV4ForCausalLM(hf_cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 / p.shape[-1] ** 0.5) * 2)
            elif name.endswith("scale"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g) + (1.0 if "norm" in name or "layernorm" in name else 0.0))
        for name, b in m.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[: cfg.num_experts_per_tok]
                                     for _ in range(b.shape[0])]))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return m


@dataclass
class Call:
    """One forward call of a hooked module: its positional and keyword inputs and its output."""

    args: tuple
    kwargs: dict
    output: object


def capture(modules: dict[str, nn.Module], run: Callable[[], object]) -> dict[str, list[Call]]:
    """Run ``run()`` with forward hooks on ``modules``; returns each module's calls in order
    (how a component test gets the inputs the oracle's own forward fed a module)."""
    calls: dict[str, list[Call]] = {name: [] for name in modules}
    handles = [m.register_forward_hook(lambda mod, a, kw, out, name=name: calls[name].append(Call(a, kw, out)),
                                       with_kwargs=True) for name, m in modules.items()]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return calls


def interp_check_result(script: str, timeout: int = 600) -> dict:
    """Run ``tests/<script>`` in a subprocess with TRITON_INTERPRET=1 (set before triton is imported)
    and return the JSON of its last ``RESULT`` line."""
    assert triton_importable(), "triton is part of the test set-up (pip install -e '.[kernels]'); the interpreter tests need it"
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "tests" / script)], cwd=root, capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)})
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")][-1][len("RESULT"):])


def prefill_then_decode(m, ids: torch.Tensor, n_prefill: int):
    """Logits [B, S, V] of ``m.prefill`` on the first ``n_prefill`` tokens, then one
    ``decode_step`` per remaining token, and the decode state they leave."""
    with torch.no_grad():
        st = m.new_state(ids.shape[0], ids.shape[1])
        parts = [m.prefill(ids[:, :n_prefill], st)]
        for t in range(n_prefill, ids.shape[1]):
            parts.append(m.decode_step(ids[:, t : t + 1], st))
            st.pos += 1
    return torch.cat(parts, 1), st


class Counting:
    """A kernel-slot callable that counts its calls and runs ``fn`` (components() shows fn's name)."""

    def __init__(self, fn):
        self.fn, self.calls, self.keywords = fn, 0, {}
        self.__name__ = fn.__name__
        self.takes_ring = getattr(fn, "takes_ring", False)  # what the slot's caller asks of fn
        self.takes_pending_sinkhorn = getattr(fn, "takes_pending_sinkhorn", False)

    def __call__(self, *a, **k):
        self.calls += 1
        for name in k:
            self.keywords[name] = self.keywords.get(name, 0) + 1
        return self.fn(*a, **k)


def decode_logits(m, ids: torch.Tensor, steps: int = 6) -> torch.Tensor:
    """Prefill ids[:, :-steps] then decode the rest one token at a time: [steps, B, V]."""
    n = ids.shape[1] - steps
    st = m.new_state(ids.shape[0], ids.shape[1] + 1)
    out = []
    with torch.no_grad():
        m.prefill(ids[:, :n], st)
        for i in range(n, ids.shape[1]):
            out.append(m.decode_step(ids[:, i : i + 1], st)[:, -1])
            st.pos += 1
    return torch.stack(out)


def benchmark_module(name: str):
    """``benchmarks/<name>.py`` as a module (benchmarks/ is not on the test path as a package),
    registered under ``name`` so the helpers it loads itself find it; loaded once per process."""
    if name in sys.modules:
        return sys.modules[name]
    root = Path(__file__).resolve().parents[1]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    spec = importlib.util.spec_from_file_location(name, root / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def graph_equals_eager(fn, *args) -> bool:
    """fn(*args) eagerly and replayed from a CUDA graph (warm-up off the capture): bitwise the same.
    fn may return a tensor or a tuple / list of them."""
    eager = fn(*args)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(*args)  # warm-up (compiles) off the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    eagers = tuple(eager) if isinstance(eager, (tuple, list)) else (eager,)
    return len(outs) == len(eagers) and all(torch.equal(a, b) for a, b in zip(outs, eagers))

