"""Prefill chunk size from free memory: the largest chunk whose transient fits.

The transient of one prefill call of C tokens (batch B, context N = start + C, activation bytes a,
fp32 = 4) is a per-token term times B*C, plus the attention's blocks, plus the paths that
materialise [C, L] rows when something needs them (formula and numbers: docs/memory_plan.md):

    per_token = 4 * (6*hc*D + 4*H*Dh + 4*(Dh + Ih) + 2*Hi*Ih + 2*k_idx + 4*k_moe*I + 3*I) + V*(4 + a)
    blocks    = min(block_bytes, 16*B*H*C*L) + min(block_bytes, 8*B*Hi*C*T)   (attention, indexer)
    dense     = 16 * B*H*C*L  (only when ``hook_probs`` listens / training / prefill_path "dense")
    dense_ix  = 8 * B*Hi*C*T  (only when an indexer hook listens: its whole [C, Hi, T] scores)

with L = min(window - 1, start) + C + N // min_ratio keys and T = N // 4 (CSA) entries. The
per-token term counts (in fp32, conservatively) the mHC streams and their mixes, the queries and
the attention output (plus their RoPE copies), the compressors' projections, the indexer's
queries, the chosen indices (int64), the routed and shared experts' SwiGLU and the final logits
(fp32 and the head's output). It does not count weights dequantised on the fly (the reference
linears without kernels): leave that to the ``fraction`` of free memory the chunk may take.
"""
from __future__ import annotations

import os

import torch

from ..config import CSA, SLIDING, DSV4Config

CPU_MAX_CHUNK = 8192   # a CPU prefill gains nothing from larger chunks; keeps host memory tame


def free_bytes(device: torch.device | str) -> int:
    """Free memory: ``torch.cuda.mem_get_info`` on CUDA, available physical pages on the CPU
    (``os.sysconf``; 0 where the platform does not say)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0


def per_token_bytes(config: DSV4Config, act_bytes: int) -> int:
    c = config
    has_csa = CSA in c.layer_types
    ix = (2 * c.index_n_heads * c.index_head_dim + 2 * c.index_topk) if has_csa else 0
    fp32_words = (6 * c.hc_mult * c.hidden_size + 4 * c.num_attention_heads * c.head_dim
                  + 4 * (c.head_dim + c.index_head_dim) + ix
                  + 4 * c.num_experts_per_tok * c.moe_intermediate_size + 3 * c.moe_intermediate_size)
    return 4 * fp32_words + c.vocab_size * (4 + act_bytes)


def prefill_transient_bytes(config: DSV4Config, chunk: int, start: int = 0, batch: int = 1, act_bytes: int = 2,
                            block_bytes: int = 0, dense_attention: bool = False, dense_indexer: bool = False) -> int:
    """The formula of the module docstring for one prefill call of ``chunk`` tokens at ``start``."""
    c = config
    n = start + chunk
    ratios = [c.compress_ratio(i) for i in range(c.num_hidden_layers) if c.layer_types[i] != SLIDING]
    L = min(c.sliding_window - 1, start) + chunk + (n // min(ratios) if ratios else 0)
    attn = 16 * batch * c.num_attention_heads * chunk * L
    ix = 8 * batch * c.index_n_heads * chunk * (n // int(c.compress_rates[CSA])) if CSA in c.layer_types else 0
    total = batch * chunk * per_token_bytes(c, act_bytes) + min(block_bytes, attn) + min(block_bytes, ix)
    return total + (attn if dense_attention else 0) + (ix if dense_indexer else 0)


def choose_chunk(config: DSV4Config, n_tokens: int, free: int, start: int = 0, batch: int = 1, act_bytes: int = 2,
                 block_bytes: int = 0, dense_attention: bool = False, dense_indexer: bool = False,
                 fraction: float = 0.5, cap: int | None = None) -> int:
    """The largest chunk (<= n_tokens, <= cap; a multiple of 256 when >= 256) whose transient,
    ending at the last token (the most keys), is within ``fraction * free``; at least 1."""
    budget = fraction * free
    end = start + n_tokens

    def fits(ch: int) -> bool:  # a chunk of ch tokens ending at the last token: the most keys
        return prefill_transient_bytes(config, ch, end - ch, batch, act_bytes, block_bytes,
                                       dense_attention, dense_indexer) <= budget

    hi = min(n_tokens, cap or n_tokens)
    if fits(hi):
        return hi
    lo = 1
    while lo < hi - 1:  # fits(lo) assumed; the transient grows with the chunk
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo - lo % 256 if lo >= 256 else lo
