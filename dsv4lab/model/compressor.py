"""CSA / HCA KV compressor: one compressed entry per closed window of ``ratio`` tokens.

Entry w = kv_norm( sum_slots softmax(Z + ape)_slot * C_slot ) with RoPE (compress theta) at
position w*ratio. The position bias ``ape`` goes into the softmax logits only, never into C.
HCA: the window's own ``ratio`` tokens. CSA (``overlap``): projections are 2*d wide, halves Ca|Cb;
entry w pools Ca of window w-1 and Cb of window w over 2*ratio slots (window 0's Ca slots are
empty: weight 0). The softmax runs per channel over the slots, in fp32.

Round trips (``round_trips``, set by dsv4lab.precision): the attention's compressor takes
``kv_fp8`` on its entries (non-RoPE dims, FP8 per 64); the indexer's (``rotate``) takes
``indexer_fp4`` (Hadamard rotation, FP4 per 32), as DeepSeek's reference does after norm and RoPE.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..config import DSV4Config
from ..quant.modes import RoundTrip
from .component import Component
from .hooks import HookPoint
from .linear import QLinear
from .norms import RMSNorm
from .rope import Rotary, apply_rope
from .roundtrips import indexer_fp4_round_trip, kv_fp8_round_trip
from .state import CompressorState


class Compressor(Component):
    def __init__(self, config: DSV4Config, dim: int, ratio: int, overlap: bool, rotate: bool = False) -> None:
        super().__init__()
        self.rotate = rotate  # the indexer's keys: its round trip is indexer_fp4, not kv_fp8
        self.ROUND_TRIPS = (RoundTrip.INDEXER_FP4,) if rotate else (RoundTrip.KV_FP8,)
        self.round_trips: frozenset = frozenset()  # of RoundTrip; set by dsv4lab.precision
        self.dim = dim
        self.ratio = ratio
        self.overlap = overlap
        c = 2 if overlap else 1
        self.wkv = QLinear(config.hidden_size, c * dim)
        self.wgate = QLinear(config.hidden_size, c * dim)
        self.ape = nn.Parameter(torch.zeros(ratio, c * dim))
        self.norm = RMSNorm(dim, config.rms_norm_eps)
        self.rotary = Rotary(config, "compress")
        self.hook_weights = HookPoint("softmax pooling weights [B,n_windows,slots,d] (fp32; CSA slots = m prev-Ca then m Cb)")
        self.kernel = None  # optional fused softmax pool f(kv_slots, gate_slots) -> pooled (not with hook_weights active)
        # optional fused decode step f(compressor, wkv(x), wgate(x), pos, state) -> entry count; used only
        # where decode_kernel_applies() (no hooks, no round trips, the fused methods not replaced)
        self.decode_kernel = None
        # optional fused kv_norm + RoPE (+ kv_fp8) of the pooled entries, with norm_rope_ref's signature
        # (dsv4lab.kernels); used where fused_norm_rope() (the norm and rotary stock, not training)
        self.rope_kernel: Callable | None = None
        self.hook_entries = HookPoint("new compressed entries [B,n_windows,d] (after kv_norm and RoPE)")

    # ------------------------------------------------------------------ core
    def project(self, x: torch.Tensor, slot_in_window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw C and Z + ape (fp32) for tokens x [B,S,D] at window offsets [S]."""
        return self.wkv(x), self.gate_logits(self.wgate(x), slot_in_window)

    def gate_logits(self, z: torch.Tensor, slot_in_window: torch.Tensor) -> torch.Tensor:
        """Z + ape in fp32: the position bias goes into the softmax logits only, never into C."""
        return z.float() + self.ape.float().index_select(0, slot_in_window)

    def pool(self, kv_slots: torch.Tensor, gate_slots: torch.Tensor, window_idx: torch.Tensor) -> torch.Tensor:
        """[B,nW,L,d] slots -> entries [B,nW,d] at positions window_idx*ratio."""
        if self.kernel is not None and not self.hook_weights.active:  # the kernel never materialises w
            pooled = self.kernel(kv_slots, gate_slots)
        else:
            w = self.hook_weights(torch.softmax(gate_slots, dim=2, dtype=torch.float32))
            pooled = (kv_slots * w.to(kv_slots.dtype)).sum(dim=2)
        positions = window_idx * self.ratio
        kv_fp8 = not self.rotate and RoundTrip.KV_FP8 in self.round_trips
        if self.rope_kernel is not None and self.fused_norm_rope():  # one launch for the norm, RoPE and kv_fp8
            entries = self.rope_kernel(pooled.unsqueeze(-2), positions, self.rotary.inv_freq, eps=self.norm.eps,
                                       weight=self.norm.weight, fp8_nope=kv_fp8).squeeze(-2)
        else:
            cos, sin = self.rotary(positions)
            entries = apply_rope(self.norm(pooled), cos, sin)
            if kv_fp8:
                entries = kv_fp8_round_trip(entries, cos.shape[-1] * 2)
        if self.rotate and RoundTrip.INDEXER_FP4 in self.round_trips:
            entries = indexer_fp4_round_trip(entries)
        return self.hook_entries(entries)

    def fused_norm_rope(self) -> bool:
        """Does ``pool`` run ``rope_kernel``? The norm and rotary stock (a replaced one is not what
        the kernel computes) and not training (the kernel has no backward). ``hook_entries`` sees
        the kernel's entries (within its tolerance of the reference's)."""
        return (type(self.norm) is RMSNorm and type(self.rotary).forward is Rotary.forward
                and not (self.training and torch.is_grad_enabled()))

    def _slots(self, kv_w: torch.Tensor, gate_w: torch.Tensor, prev_kv: torch.Tensor, prev_gate: torch.Tensor):
        """Per-window slots from window-shaped projections [B,n,m,c*d] (+ the window before)."""
        if not self.overlap:
            return kv_w, gate_w
        d = self.dim
        return (torch.cat([prev_kv[..., :d], kv_w[..., d:]], dim=2),
                torch.cat([prev_gate[..., :d], gate_w[..., d:]], dim=2))

    # --------------------------------------------------------------- prefill
    def prefill(self, x: torch.Tensor, start: int, st: CompressorState) -> int:
        """Process tokens at positions start..start+S-1; write closed windows' entries into
        ``st.entries`` and the raw ring. Returns the number of entries now valid."""
        B, S, _ = x.shape
        m, R = self.ratio, st.ring_kv.shape[1]
        pos = torch.arange(start, start + S, device=x.device)
        kv, gate = self.project(x, pos % m)
        w_first, w_last = start // m, (start + S) // m - 1
        if w_last >= w_first:
            lo = (w_first - 1) * m  # first position of the window before the first closing one
            hi = (w_last + 1) * m
            pieces_kv, pieces_gate = [], []
            n_pad = max(0, -lo)
            if n_pad:
                pieces_kv.append(kv.new_zeros(B, n_pad, kv.shape[-1]))
                pieces_gate.append(gate.new_full((B, n_pad, gate.shape[-1]), float("-inf")))
            ring_lo = max(lo, 0)
            if ring_lo < start:
                slots = torch.arange(ring_lo, start, device=x.device) % R
                pieces_kv.append(st.ring_kv.index_select(1, slots).to(kv.dtype))
                pieces_gate.append(st.ring_gate.index_select(1, slots))
            pieces_kv.append(kv[:, : hi - start])
            pieces_gate.append(gate[:, : hi - start])
            ext_kv = torch.cat(pieces_kv, 1).unflatten(1, (-1, m))      # [B, n+1, m, c*d]
            ext_gate = torch.cat(pieces_gate, 1).unflatten(1, (-1, m))
            kv_s, gate_s = self._slots(ext_kv[:, 1:], ext_gate[:, 1:], ext_kv[:, :-1], ext_gate[:, :-1])
            widx = torch.arange(w_first, w_last + 1, device=x.device)
            st.entries[:, w_first : w_last + 1] = self.pool(kv_s, gate_s, widx).to(st.entries.dtype)
        # keep the last R raw positions in the ring
        keep = min(S, R)
        slots = pos[-keep:] % R
        st.ring_kv.index_copy_(1, slots, kv[:, -keep:].to(st.ring_kv.dtype))
        st.ring_gate.index_copy_(1, slots, gate[:, -keep:])
        return (start + S) // m

    # ---------------------------------------------------------------- decode
    def decode(self, x: torch.Tensor, pos: torch.Tensor, st: CompressorState) -> torch.Tensor:
        """One token (x [B,1,D]) at device position ``pos``; emits its window's entry on the
        device when the window closes (masked write, no host branch). Returns the entry count."""
        if self.decode_kernel is not None and self.decode_kernel_applies():
            return self.decode_kernel(self, self.wkv(x), self.wgate(x), pos, st)
        kv, gate = self.project(x, (pos % self.ratio).view(1))
        return self.decode_window(kv, gate, pos, st)

    def decode_kernel_applies(self) -> bool:
        """May ``decode_kernel`` stand in for the reference? Not while a hook listens (it
        materialises neither the weights nor a non-closing step's entry), under a round trip (it
        implements none), or when a method or submodule it fuses was replaced (bug variants,
        component swaps)."""
        cls = type(self)
        return (not self.hook_weights.active and not self.hook_entries.active and not self.round_trips
                and all(getattr(cls, n) is getattr(Compressor, n) for n in DECODE_KERNEL_FUSES)
                and type(self.norm).forward is RMSNorm.forward and type(self.rotary).forward is Rotary.forward
                and not any(m._forward_hooks or m._forward_pre_hooks for m in (self.norm, self.rotary)))

    def decode_window(self, kv: torch.Tensor, gate: torch.Tensor, pos: torch.Tensor, st: CompressorState) -> torch.Tensor:
        """The reference decode after ``project``: ring write, the window's pool, masked entry write."""
        m, R = self.ratio, st.ring_kv.shape[1]
        slot = (pos % R).view(1)
        st.ring_kv.index_copy_(1, slot, kv.to(st.ring_kv.dtype))
        st.ring_gate.index_copy_(1, slot, gate)
        w = pos // m
        base = torch.arange(m, device=kv.device)
        if self.overlap:
            cur = (w % 2) * m + base
            prev = ((w + 1) % 2) * m + base
            kv_s, gate_s = self._slots(st.ring_kv.index_select(1, cur).unsqueeze(1), st.ring_gate.index_select(1, cur).unsqueeze(1),
                                       st.ring_kv.index_select(1, prev).unsqueeze(1), st.ring_gate.index_select(1, prev).unsqueeze(1))
        else:
            kv_s, gate_s = st.ring_kv.unsqueeze(1), st.ring_gate.unsqueeze(1)
        entry = self.pool(kv_s.to(kv.dtype), gate_s, w.view(1))  # [B,1,d]
        closes = (pos + 1) % m == 0
        idx = torch.clamp(w, max=st.entries.shape[1] - 1).view(1)
        old = st.entries.index_select(1, idx)
        st.entries.index_copy_(1, idx, torch.where(closes, entry.to(old.dtype), old))
        return (pos + 1) // m


# the methods the decode kernel computes itself: a subclass overriding one keeps the reference
DECODE_KERNEL_FUSES = ("project", "gate_logits", "_slots", "pool", "decode_window")
