"""The reference attention of one decode step: the keys and additive mask it attends, and the
sink softmax over them (the math ``Attention._attend`` uses, shared so that the decode kernel's
oracle and the component cannot drift apart).

Keys of a decode step: the whole sliding-window ring [B, W, Dh] (slot i = the latest position
p with p % W == i; valid while i <= pos) followed by the compressed entries: every closed one
(w < n_entries: HCA, or CSA with the indexer off) or the indexer's choice gathered by index
(``selected`` [B,1,k], -1 = none). ``pos`` and ``n_entries`` are device tensors: no host
branch, fixed shapes (the ring and entry arrays are attended whole, invalid slots get -inf).
"""
from __future__ import annotations

import torch


def masked_logits(q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """Scaled, masked logits [B,H,S,L] of q [B,S,H,Dh] over keys [B,L,Dh], bias [B or 1,S,L]."""
    logits = torch.matmul(q.transpose(1, 2), keys.unsqueeze(1).transpose(-1, -2)) * scale  # [B,H,S,L]
    return logits + bias.unsqueeze(1).to(logits.dtype)


def sink_softmax(logits: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Probabilities [B,H,S,L+1] over [keys | sink] (the sink logit per head, not scaled)."""
    B, H, S, _ = logits.shape
    sinks = sink.to(logits.dtype).view(1, H, 1, 1).expand(B, H, S, 1)
    combined = torch.cat([logits, sinks], dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    return torch.softmax(combined, dim=-1)


def decode_keys_bias(window_ring: torch.Tensor, pos: torch.Tensor, entries: torch.Tensor | None = None,
                     n_entries: torch.Tensor | None = None, selected: torch.Tensor | None = None,
                     use_compressed: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [B, W (+ T or k), Dh] and bias [B, 1, same] of one decode step (see the module
    docstring); ``use_compressed=False`` keeps the entries in the keys, all masked."""
    B, W = window_ring.shape[:2]
    dev = window_ring.device
    zero = torch.zeros((), device=dev)
    neg = torch.full((), float("-inf"), device=dev)
    bias = torch.where(torch.arange(W, device=dev) <= pos, zero, neg).view(1, 1, W).expand(B, 1, W)
    if entries is None:
        return window_ring, bias
    if selected is not None:
        ent_bias = torch.where(selected >= 0, zero, neg)
        entries = torch.gather(entries, 1, selected.clamp(min=0).view(B, -1, 1).expand(-1, -1, entries.shape[-1]))
    else:
        T = entries.shape[1]
        ent_bias = torch.where(torch.arange(T, device=dev) < n_entries, zero, neg).view(1, 1, T).expand(B, 1, T)
    if not use_compressed:
        ent_bias = torch.full_like(ent_bias, float("-inf"))
    return torch.cat([window_ring, entries], dim=1), torch.cat([bias, ent_bias], dim=-1)


def decode_attention(q: torch.Tensor, sink: torch.Tensor, scale: float, window_ring: torch.Tensor,
                     pos: torch.Tensor, entries: torch.Tensor | None = None, n_entries: torch.Tensor | None = None,
                     selected: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence, q [B,1,H,Dh], over the window ring and the entries (all
    w < ``n_entries``, or the ``selected`` ones): [B,1,H,Dh] in the keys' dtype. The reference
    of ``dsv4lab.kernels.attention_decode`` (the signature of ``Attention.decode_kernel``)."""
    keys, bias = decode_keys_bias(window_ring, pos, entries, n_entries, selected)
    probs = sink_softmax(masked_logits(q, keys, bias, scale), sink)
    out = torch.matmul(probs[..., :-1].to(keys.dtype), keys.unsqueeze(1))  # [B,H,1,Dh]
    return out.transpose(1, 2)
