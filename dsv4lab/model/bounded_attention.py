"""Memory-bounded prefill attention: the same softmax as ``Attention._attend`` over
[sliding window | compressed entries] with the learned per-head sink, computed per block of
queries with an online softmax over blocks of keys, so nothing of size [heads, S, L] exists.

Per query block of ``q_block`` rows the running state is m (max, started at the sink logit),
l (sum of exp, started at exp(sink - sink) = 1) and acc (sum of exp * V, fp32). Key segments:

* the sliding window: the keys at positions [first query - window + 1, last query] of
  ``window_keys``, masked to 0 <= q_pos - k_pos < window;
* HCA (and CSA with the indexer off): every closed entry w < (q_pos + 1) // ratio;
* CSA: the indexer's chosen entries per query (``selected`` [B,S,k], -1 = none), gathered
  per query ([B, q_block, k_block, Dh]) and scored as a batch of [H, Dh] x [Dh, k_block].

Peak transient per block (B batch, H heads, Dh head dim, a = bytes of the keys' dtype):
``B * q_block * (3 * H * k_block * 4 + H * Dh * 8 + k_block * Dh * a)`` (logits + exp + mask
broadcast, the fp32 accumulator and its update, the gathered entries), plus the inputs.
Block sizes come from :func:`block_rows` unless given. Positions are host ints (prefill knows
them), so no block size or key range depends on a device value.
"""
from __future__ import annotations

import torch

DEFAULT_BLOCK_BYTES = 256 * 2**20   # per-block working set the block sizes aim for
DEFAULT_K_BLOCK = 1024               # keys per block (V4-Pro's index_topk: one gathered block)


def block_rows(budget: int, per_row: int, n_rows: int) -> int:
    """Rows of a block whose ``per_row`` bytes stay within ``budget`` (at least 1, at most all)."""
    return max(1, min(n_rows, budget // max(per_row, 1)))


def attention_block_bytes(batch: int, heads: int, head_dim: int, q_block: int, k_block: int, key_bytes: int) -> int:
    """The per-block transient stated in the module docstring."""
    return batch * q_block * (3 * heads * k_block * 4 + heads * head_dim * 8 + k_block * head_dim * key_bytes)


class _Online:
    """Online-softmax state of one query block, [B, bq, H, *]; starts from the sink alone."""

    def __init__(self, sink: torch.Tensor, B: int, bq: int, D: int, device) -> None:
        H = sink.shape[0]
        self.m = sink.float().view(1, 1, H, 1).expand(B, bq, H, 1).clone()
        self.l = torch.ones(B, bq, H, 1, device=device)
        self.acc = torch.zeros(B, bq, H, D, device=device)

    def update(self, logits: torch.Tensor, pv) -> None:
        """``logits`` [B,bq,H,n] fp32 (-inf = masked; consumed in place); ``pv(p)`` -> [B,bq,H,D]."""
        m_new = torch.maximum(self.m, logits.amax(dim=-1, keepdim=True))
        alpha = torch.exp(self.m - m_new)
        p = logits.sub_(m_new).exp_()
        self.l.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
        self.acc.mul_(alpha).add_(pv(p))
        self.m = m_new

    def result(self) -> torch.Tensor:
        return self.acc / self.l


def _shared_keys(st: _Online, qf: torch.Tensor, keys: torch.Tensor, ok: torch.Tensor, scale: float) -> None:
    """Keys shared by every query of the block: qf [B, bq*H, Dh], keys [B, n, Dh], ok [bq, n]."""
    B, n = keys.shape[0], keys.shape[1]
    bq, H = st.m.shape[1], st.m.shape[2]
    logits = torch.matmul(qf, keys.transpose(1, 2)).view(B, bq, H, n).float().mul_(scale)
    logits.masked_fill_(~ok.view(1, bq, 1, n), float("-inf"))
    st.update(logits, lambda p: torch.matmul(p.view(B, bq * H, n).to(keys.dtype), keys).view(B, bq, H, -1).float())


def _gathered_keys(st: _Online, qb: torch.Tensor, entries: torch.Tensor, sel: torch.Tensor, scale: float) -> None:
    """Per-query keys: qb [B,bq,H,Dh], entries [B,T,Dh], sel [B,bq,n] (-1 = none)."""
    B, bq, H, D = qb.shape
    n = sel.shape[-1]
    bidx = torch.arange(B, device=sel.device).view(B, 1, 1)
    g = entries[bidx, sel.clamp(min=0)].view(B * bq, n, D)                       # [B*bq, n, Dh]
    logits = torch.matmul(qb.reshape(B * bq, H, D), g.transpose(1, 2)).view(B, bq, H, n).float().mul_(scale)
    logits.masked_fill_((sel < 0).view(B, bq, 1, n), float("-inf"))
    st.update(logits, lambda p: torch.matmul(p.view(B * bq, H, n).to(g.dtype), g).view(B, bq, H, D).float())


def bounded_attention(q: torch.Tensor, sink: torch.Tensor, scale: float, window: int,
                      window_keys: torch.Tensor, q_start: int, k_start: int,
                      entries: torch.Tensor | None = None, ratio: int = 0,
                      selected: torch.Tensor | None = None,
                      q_block: int | None = None, k_block: int | None = None,
                      block_bytes: int = DEFAULT_BLOCK_BYTES) -> torch.Tensor:
    """q [B,S,H,Dh] at positions q_start.. ; window_keys [B,P,Dh] (K == V) at k_start..;
    entries [B,T,Dh] (None: window only) visible to query t when w < (t + 1) // ratio, or only
    the ``selected`` ones. Returns [B,S,H,Dh] in the keys' dtype."""
    B, S, H, D = q.shape
    dev = q.device
    kb = k_block or DEFAULT_K_BLOCK
    if q_block is None:
        per_row = attention_block_bytes(B, H, D, 1, kb, window_keys.element_size())
        q_block = block_rows(block_bytes, per_row, S)
    P = window_keys.shape[1]
    out = torch.empty(B, S, H, D, dtype=window_keys.dtype, device=dev)
    for a in range(0, S, q_block):
        b = min(S, a + q_block)
        bq = b - a
        qb = q[:, a:b].contiguous()
        qf = qb.view(B, bq * H, D)
        qpos = torch.arange(q_start + a, q_start + b, device=dev)
        st = _Online(sink, B, bq, D, dev)
        # sliding window: keys at positions [q_start+a-window+1, q_start+b-1] that exist
        j0 = max(0, q_start + a - window + 1 - k_start)
        j1 = min(P, q_start + b - k_start)
        for c0 in range(j0, j1, kb):
            c1 = min(j1, c0 + kb)
            rel = qpos.view(-1, 1) - torch.arange(k_start + c0, k_start + c1, device=dev).view(1, -1)
            _shared_keys(st, qf, window_keys[:, c0:c1], (rel >= 0) & (rel < window), scale)
        if entries is not None and selected is not None:
            sel = selected[:, a:b]
            for c0 in range(0, sel.shape[-1], kb):
                _gathered_keys(st, qb, entries, sel[..., c0 : c0 + kb], scale)
        elif entries is not None:
            n_vis = min(entries.shape[1], (q_start + b) // ratio)   # the last query sees the most
            vis = (qpos + 1) // ratio
            for c0 in range(0, n_vis, kb):
                c1 = min(n_vis, c0 + kb)
                ok = torch.arange(c0, c1, device=dev).view(1, -1) < vis.view(-1, 1)
                _shared_keys(st, qf, entries[:, c0:c1], ok, scale)
        out[:, a:b] = st.result().to(out.dtype)
    return out
