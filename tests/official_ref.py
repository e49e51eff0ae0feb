"""DeepSeek's official inference arithmetic, written from its equations for the tests, with no
dsv4lab code: the round trips (FP8 / FP4 with power-of-two scales, the Walsh-Hadamard rotation)
and a transformers DeepseekV4ForCausalLM patched to run them where the official code does.

The round trips (docs/precision.md):
  act  FP8/FP4-weight linears (not wo_a): x -> e4m3(x/s)*s per 128, s = 2^ceil(log2(max(amax,1e-4)/448))
  w2   routed experts: y = w2(weight * SiLU(min(g, L)) * clamp(u, -L, L))
  kv   window KV and main compressed entries, after norm and RoPE: the non-RoPE dims per 64 as act
  ix   indexer q (after RoPE) and k (entries after norm and RoPE): x -> H x / sqrt(d), then
       E2M1(x/s)*s per 32, s = 2^ceil(log2(max(amax, 6*2^-126)/6))
  pv   attention: e = exp(l - max over keys); out = (bf16(e) @ V) / (sum e + exp(sink - max))
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
ALL = ("act", "w2", "kv", "ix", "pv")


def hadamard_matrix(d: int) -> torch.Tensor:
    """Sylvester order by its entry formula: H[i, j] = (-1)^popcount(i & j)."""
    bits = torch.arange(d).view(-1, 1) & torch.arange(d).view(1, -1)
    pop = torch.zeros_like(bits)
    for b in range(max(1, d.bit_length())):
        pop += (bits >> b) & 1
    return (1 - 2 * (pop % 2)).double()


def e2m1_nearest(v: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value (float64), ties to the even grid index, saturating at +-6."""
    a = v.abs().clamp(max=6.0).unsqueeze(-1)
    dist = (a - E2M1_GRID).abs()
    best = dist.min(dim=-1, keepdim=True).values
    idx = torch.arange(8).expand_as(dist)
    cand = torch.where(dist == best, idx, torch.full_like(idx, 99))
    even = torch.where(cand % 2 == 0, cand, torch.full_like(cand, 99)).min(-1).values
    pick = torch.where(even < 99, even, cand.min(-1).values)
    return torch.sign(v) * E2M1_GRID[pick]


def pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    return 2.0 ** torch.ceil(torch.log2(amax / qmax))


def fp8_pow2(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per-``block`` e4m3 round trip along the last dim (a partial last block allowed)."""
    k = x.shape[-1]
    out = torch.empty_like(x)
    for lo in range(0, k, block):
        xb = x[..., lo:lo + block].double()
        s = pow2_scale(xb.abs().amax(-1, keepdim=True).clamp_min(1e-4), 448.0)
        out[..., lo:lo + block] = ((xb / s).clamp(-448, 448).float().to(torch.float8_e4m3fn).double() * s).to(x.dtype)
    return out


def fp4_pow2(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    k = x.shape[-1]
    xb = x.double().reshape(*x.shape[:-1], k // block, block)
    s = pow2_scale(xb.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0 ** -126), 6.0)
    return (e2m1_nearest(xb / s) * s).reshape(x.shape).to(x.dtype)


def rotate_fp4(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    return fp4_pow2((x.double() @ hadamard_matrix(d) / math.sqrt(d)).to(x.dtype))


def kv_fp8(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    return torch.cat([fp8_pow2(x[..., :-rope_dim], 64), x[..., -rope_dim:]], dim=-1)


# ------------------------------------------------------------------------------ the patched oracle
ACT_LINEARS = ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_proj", "self_attn.o_b_proj",
               "self_attn.compressor.indexer.q_b_proj", "mlp.shared_experts.gate_proj",
               "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj")


class Stats:
    """What the patched oracle saw (so a test can show a branch was exercised)."""

    def __init__(self) -> None:
        self.clamped = 0          # expert gate pre-activations above the SwiGLU limit
        self.kv = self.entries = self.index = 0


@contextmanager
def official_oracle(hf, trips=ALL):
    """Patch the transformers model ``hf`` (in place, undone on exit) to run the official round
    trips named in ``trips``; yields a :class:`Stats`."""
    import transformers.models.deepseek_v4.modeling_deepseek_v4 as M  # lazy: heavy optional dependency

    stats = Stats()
    frames: list = []           # (kind, calls so far) of the attention / compressor / indexer running
    handles = []
    rope_dim = hf.config.qk_rope_head_dim if hasattr(hf.config, "qk_rope_head_dim") else \
        int(hf.config.head_dim * hf.config.partial_rotary_factor)
    orig_rope, orig_eager = M.apply_rotary_pos_emb, M.eager_attention_forward
    orig_experts = M.DeepseekV4Experts.forward

    def rope(x, cos, sin, unsqueeze_dim=1):
        y = orig_rope(x, cos, sin, unsqueeze_dim)
        if not frames:
            return y
        kind, n = frames[-1]
        frames[-1] = (kind, n + 1)
        if kind == "attn" and n == 1 and "kv" in trips:        # calls: q, kv, (output)
            stats.kv += 1
            return kv_fp8(y, rope_dim)
        if kind == "compressor" and "kv" in trips:
            stats.entries += 1
            return kv_fp8(y, rope_dim)
        if kind == "indexer" and "ix" in trips:                # the keys, then the queries
            stats.index += 1
            return rotate_fp4(y)
        return y

    def eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        if "pv" not in trips:
            return orig_eager(module, query, key, value, attention_mask, scaling, dropout, **kw)
        logits = torch.matmul(query, key.transpose(2, 3)) * scaling
        if attention_mask is not None:
            logits = logits + attention_mask
        m = logits.amax(-1, keepdim=True)
        e = torch.exp(logits - m)
        denom = e.sum(-1, keepdim=True) + torch.exp(module.sinks.view(1, -1, 1, 1) - m)
        out = torch.matmul(e.to(torch.bfloat16).float(), value.float()) / denom
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    def experts(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        lim = self.limit
        for t in range(x.shape[0]):
            for j in range(top_k_index.shape[1]):
                e = int(top_k_index[t, j])
                xt = fp8_pow2(x[t:t + 1], 128) if "act" in trips else x[t:t + 1]
                g, u = F.linear(xt, self.gate_up_proj[e]).chunk(2, dim=-1)
                if lim is not None and lim > 0:
                    stats.clamped += int((g > lim).sum())
                    g, u = g.clamp(max=lim), u.clamp(-lim, lim)
                h = F.silu(g) * u
                w = top_k_weights[t, j]
                if "w2" in trips:
                    h = h * w
                if "act" in trips:
                    h = fp8_pow2(h, 128)
                y = F.linear(h, self.down_proj[e])
                out[t] += (y if "w2" in trips else y * w)[0]
        return out

    def enter(kind):
        return lambda mod, args: frames.append((kind, 0))

    def leave(mod, args, out):
        frames.pop()

    for name, mod in hf.named_modules():
        kind = {"DeepseekV4Attention": "attn", "DeepseekV4HCACompressor": "compressor",
                "DeepseekV4CSACompressor": "compressor", "DeepseekV4Indexer": "indexer"}.get(type(mod).__name__)
        if kind:
            handles += [mod.register_forward_pre_hook(enter(kind)), mod.register_forward_hook(leave)]
        if "act" in trips and name.split(".", 3)[-1] in ACT_LINEARS:
            handles.append(mod.register_forward_pre_hook(lambda mod, args: (fp8_pow2(args[0], 128),)))
    M.apply_rotary_pos_emb, M.eager_attention_forward, M.DeepseekV4Experts.forward = rope, eager, experts
    try:
        yield stats
    finally:
        M.apply_rotary_pos_emb, M.eager_attention_forward, M.DeepseekV4Experts.forward = orig_rope, orig_eager, orig_experts
        for h in handles:
            h.remove()
