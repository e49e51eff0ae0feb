"""DSV4 attention: low-rank queries, one shared K=V head, sliding window + compressed entries.

q = RoPE(rms(wq_b(q_norm(wq_a(x))))) per head; kv = RoPE(kv_norm(wkv(x))) (one head, K == V);
logits over [sliding-window keys | compressed entries] scaled by head_dim^-0.5, a learned per-head
sink logit joins the softmax (not scaled), masked slots get -inf. The output's rope slice is
rotated back (RoPE at -pos), then the grouped projection wo_a (per group) and wo_b.

Round trips of DeepSeek's reference (``round_trips``, set by dsv4lab.precision): ``kv_fp8``
puts the new KV's non-RoPE dims through FP8 per 64 with power-of-two scales after kv_norm and
RoPE (the window ring stores that); ``probs_bf16`` rounds the unnormalised probabilities
exp(l - max) to bf16 before P.V and divides by their fp32 sum (sink included) afterwards.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..config import CSA, SLIDING, DSV4Config
from ..lanes import Fork, forks_now
from ..quant.modes import RoundTrip
from .bounded_attention import DEFAULT_BLOCK_BYTES, block_rows, bounded_attention
from .component import Component
from .compressor import Compressor
from .decode_attention import decode_keys_bias, masked_logits, sink_softmax
from .hooks import HookPoint
from .indexer import Indexer
from .linear import QLinear, offer_pair
from .norms import RMSNorm, unweighted_rms_norm
from .rope import Rotary, apply_rope
from .roundtrips import kv_fp8_round_trip
from .state import LayerState

PREFILL_PATHS = ("auto", "dense")  # Attention.prefill_path: "auto" picks bounded/blocked/dense


class Attention(Component):
    ROUND_TRIPS = (RoundTrip.KV_FP8, RoundTrip.PROBS_BF16)

    def __init__(self, config: DSV4Config, layer: int) -> None:
        super().__init__()
        c = config
        self.layer_type = c.layer_types[layer]
        self.n_heads = c.num_attention_heads
        self.head_dim = c.head_dim
        self.window = c.sliding_window
        self.groups = c.o_groups
        self.eps = c.rms_norm_eps
        self.scale = c.head_dim ** -0.5
        self.wq_a = QLinear(c.hidden_size, c.q_lora_rank)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.wq_b = QLinear(c.q_lora_rank, c.num_attention_heads * c.head_dim)
        self.wkv = QLinear(c.hidden_size, c.head_dim)
        self.kv_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.wo_a = QLinear(c.num_attention_heads * c.head_dim // c.o_groups, c.o_groups * c.o_lora_rank)
        self.wo_b = QLinear(c.o_groups * c.o_lora_rank, c.hidden_size)
        self.sink = nn.Parameter(torch.zeros(c.num_attention_heads))
        self.rotary = Rotary(c, "main" if self.layer_type == SLIDING else "compress")
        self.ratio = c.compress_ratio(layer)
        self.compressor = None if self.layer_type == SLIDING else Compressor(c, c.head_dim, self.ratio, self.layer_type == CSA)
        self.indexer = Indexer(c, self.ratio) if self.layer_type == CSA else None
        self.use_compressed = True  # False: attend the sliding window only (ablation)
        self.prefill_path = "auto"  # "dense": always the reference [B,H,S,L] softmax (see prefill_choice)
        self.q_block: int | None = None  # prefill query rows per block (None: from block_bytes)
        self.k_block: int | None = None  # prefill keys per block (None: DEFAULT_K_BLOCK)
        self.block_bytes = DEFAULT_BLOCK_BYTES  # working set per prefill block (attention, indexer)
        self.kernel = None  # optional bounded prefill attention with bounded_attention's signature (dsv4lab.kernels)
        self.decode_kernel = None  # optional decode attention with decode_attention's signature (dsv4lab.kernels)
        # optional fused glue of _q_kv / _output (dsv4lab.kernels; see fused_rows): q_norm as
        # rms_norm(x, weight, eps), and norm + RoPE as norm_rope_ref(x, positions, inv_freq, ...)
        self.norm_kernel: Callable | None = None
        self.rope_kernel: Callable | None = None
        # optional f(x, [weights]) -> [x @ w^T] in one launch (dsv4lab.kernels): decode's unquantised
        # projections of x by the compressors and the indexer (``_offer_plain_batch``)
        self.plain_batch_kernel: Callable | None = None
        # optional f(x, wa, wb) -> (x @ wa^T, x @ wb^T) | None in one launch (dsv4lab.kernels): decode's
        # wq_a and wkv of the same x (``_offer_quant_pair``)
        self.quant_pair_kernel: Callable | None = None
        # optional f(a, q_weight, q_eps, kv, positions, inv_freq, kv_weight, kv_eps, fp8_nope, ring) ->
        # (q_res, kv) | None in one launch (dsv4lab.kernels): decode's q_norm and kv norm + RoPE + ring
        # write, taken only while norm_kernel and rope_kernel are the slots it pairs (``pairs_with``)
        self.norm_pair_kernel: Callable | None = None
        self._prefill_ran: str | None = None  # private: a per-run result, not a switch graphs key on
        self.round_trips: frozenset = frozenset()  # of RoundTrip; set by dsv4lab.precision
        self.hook_q = HookPoint("queries [B,S,H,Dh] after norm and RoPE")
        self.hook_kv = HookPoint("new shared K=V [B,S,Dh] after kv_norm and RoPE")
        self.hook_probs = HookPoint("attention probabilities [B,H,S,L+1], last column = sink")
        self.hook_out = HookPoint("attention block output [B,S,D]")

    # -------------------------------------------------------------- pieces
    def fused_rows(self) -> bool:
        """Do ``_q_kv`` / ``_output`` run the fused slots? ``rope_kernel`` installed, the norms
        and rotary stock (a replaced one is not what the kernels compute) and neither ``hook_q``
        nor ``hook_kv`` listening (hooks see the reference's tensors), and not training (the
        kernels have no backward). Host-side checks only."""
        return (self.rope_kernel is not None and type(self.q_norm) is RMSNorm and type(self.kv_norm) is RMSNorm
                and type(self.rotary).forward is Rotary.forward
                and not (self.hook_q.active or self.hook_kv.active)
                and not (self.training and torch.is_grad_enabled()))

    def _q_kv(self, x: torch.Tensor, positions: torch.Tensor):
        """(q_res, q, kv, cos, sin): the latent query (for the indexer), the queries, the new K=V
        and the rotation for ``_output``: the cos/sin tables [S, rd/2], or (positions, None) when
        the fused slots ran (they compute the angles on the device; ``_output`` then does too)."""
        B, S, _ = x.shape
        if self.fused_rows():
            return self._q_kv_fused(x, positions)
        q_res = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_res).view(B, S, self.n_heads, self.head_dim)
        q = unweighted_rms_norm(q, self.eps)
        cos, sin = self.rotary(positions)  # [S, rd/2]
        q = self.hook_q(apply_rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2)))
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)
        if RoundTrip.KV_FP8 in self.round_trips:
            kv = kv_fp8_round_trip(kv, cos.shape[-1] * 2)
        kv = self.hook_kv(kv)
        return q_res, q, kv, cos, sin

    def _q_kv_fused(self, x: torch.Tensor, positions: torch.Tensor, ring: torch.Tensor | None = None,
                    rope_q: bool = True, with_q_res: Callable[[torch.Tensor], None] | None = None):
        """``_q_kv`` in up to three launches besides the matmuls: q_norm (``norm_kernel``), per-head norm
        + RoPE of q, kv_norm + RoPE (+ ``kv_fp8``) of kv (``rope_kernel``). ``ring``: that last
        launch also writes kv into the decode ring (``rope_kernel.takes_ring``), and it and q_norm
        may run as one launch (``_norm_pair``): two launches. ``rope_q`` False: q is wq_b's raw
        output (the decode kernel normalises and rotates it: ``_decode_unropes``). ``with_q_res``:
        called with q_res as soon as it is issued, before wq_b (decode lanes fork the indexer there)."""
        B, S, _ = x.shape
        paired = self._offer_quant_pair(x)
        inv, fp8 = self.rotary.inv_freq, RoundTrip.KV_FP8 in self.round_trips
        try:
            a, kv_lin = self.wq_a(x), self.wkv(x).unsqueeze(-2)
            normed = self._norm_pair(a, kv_lin, positions, ring, fp8) if self._norm_pairs(ring) else None
            if normed is None:
                q_res = self.q_norm(a) if self.norm_kernel is None else self.norm_kernel(a, self.q_norm.weight,
                                                                                          self.q_norm.eps)
                kv = self.rope_kernel(kv_lin, positions, inv, eps=self.kv_norm.eps, weight=self.kv_norm.weight,
                                      fp8_nope=fp8, **({} if ring is None else {"ring": ring}))
            else:
                q_res, kv = normed
            if with_q_res is not None:
                with_q_res(q_res)
            q = self.wq_b(q_res).view(B, S, self.n_heads, self.head_dim)
            if rope_q:
                q = self.hook_q(self.rope_kernel(q, positions, inv, eps=self.eps))
        finally:
            if paired:  # an offer nobody took (an exception on the way) goes
                self.wkv.offer(None)
        return q_res, q, self.hook_kv(kv.squeeze(-2)), positions, None

    def _norm_pairs(self, ring: torch.Tensor | None) -> bool:
        """May q_norm and kv's norm + RoPE + ring write run as one ``norm_pair_kernel`` launch? At
        decode (a ring), with ``norm_kernel`` and ``rope_kernel`` the slots it pairs (``pairs_with``:
        a replaced one runs as itself)."""
        k = self.norm_pair_kernel
        return (ring is not None and k is not None and getattr(self.norm_kernel, "pairs_with", None) is k
                and getattr(self.rope_kernel, "pairs_with", None) is k)

    def _norm_pair(self, a: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, ring: torch.Tensor,
                   fp8: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """q_norm of a and kv_norm + RoPE (+ kv_fp8) of kv written into ``ring`` as one
        ``norm_pair_kernel`` launch (``_norm_pairs`` checked); None where the kernel declines."""
        return self.norm_pair_kernel(a, self.q_norm.weight, self.q_norm.eps, kv, positions, self.rotary.inv_freq,
                                     self.kv_norm.weight, self.kv_norm.eps, fp8, ring)

    def _offer_quant_pair(self, x: torch.Tensor) -> bool:
        """Run wq_a and wkv of x as one ``quant_pair_kernel`` launch and ``offer`` each its output
        (both quantised linears read the same x; each output is the bits of its own launch, so hooks
        on either fire on the same tensor either way). False where a linear cannot take part
        (``QLinear.pair_weight``) or the kernel declines (not one decode token, tiles that differ)."""
        return offer_pair(self.quant_pair_kernel, x, self.wq_a, self.wkv)

    def _logits(self, q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Scaled, masked logits [B,H,S,L] of q [B,S,H,Dh] over keys [B,L,Dh], bias [B or 1,S,L]."""
        return masked_logits(q, keys, bias, self.scale)

    def _sink_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Probabilities [B,H,S,L+1] over [keys | sink] (the reference softmax)."""
        return sink_softmax(logits, self.sink)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """q [B,S,H,Dh], keys [B,L,Dh] (also the values), bias [B or 1,S,L] -> [B,S,H,Dh]."""
        B, S, H, _ = q.shape
        logits = self._logits(q, keys, bias)
        if RoundTrip.PROBS_BF16 in self.round_trips:
            sinks = self.sink.to(logits.dtype).view(1, H, 1, 1).expand(B, H, S, 1)
            # the reference kernel: e = exp(l - max over keys); P.V with e rounded to bf16 and
            # fp32 accumulators; then divided by sum(e) + exp(sink - max), in fp32
            m = logits.float().amax(dim=-1, keepdim=True)
            e_sink = torch.exp(sinks.float() - m)
            e16 = torch.exp(logits.float() - m)
            denom = e16.sum(dim=-1, keepdim=True) + e_sink   # the fp32 sum of the unrounded e
            e16 = e16.to(torch.bfloat16).float()              # replaces e: one [B,H,S,L] fp32 transient held
            self._last_probs = None
            if self.hook_probs.active or self.training:       # materialise the probabilities only to show them
                shown = torch.cat([e16, e_sink], dim=-1) / denom
                probs = self.hook_probs(shown)
                self._last_probs = probs if self.training else None
                if probs is not shown:  # a hook replaced the probabilities: use them
                    out = torch.matmul(probs[..., :-1].float(), keys.float().unsqueeze(1))
                    return out.to(keys.dtype).transpose(1, 2)
            out = torch.matmul(e16, keys.float().unsqueeze(1)) / denom
            return out.to(keys.dtype).transpose(1, 2)
        probs = self.hook_probs(self._sink_softmax(logits))
        self._last_probs = probs if self.training else None
        out = torch.matmul(probs[..., :-1].to(keys.dtype), keys.unsqueeze(1))  # [B,H,S,Dh]
        return out.transpose(1, 2)

    def _output(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor | None,
                unroped: bool = False) -> torch.Tensor:
        """Inverse RoPE (``rope_kernel`` when ``_q_kv`` handed over positions: ``sin`` is None; none
        when the decode kernel applied it: ``unroped``), the grouped wo_a, wo_b."""
        if sin is None and not unroped:
            out = self.rope_kernel(out, cos, self.rotary.inv_freq, inverse=True, inplace=True)  # out is ours
        elif sin is not None:
            out = apply_rope(out, cos.unsqueeze(-2), -sin.unsqueeze(-2))
        B, S = out.shape[:2]
        grouped = self.wo_a.grouped(out.reshape(B, S, self.groups, -1), self.groups).flatten(2)
        return self.hook_out(self.wo_b(grouped))

    # -------------------------------------------------------------- prefill
    def prefill_choice(self) -> str:
        """Which prefill path runs (``prefill_path`` = "auto"): "dense" (one ``_attend`` over
        [B,H,S,L]) in training (the indexer distils from the probabilities); "blocked" (``_attend``
        per block of queries, [B,H,rows,L] each; one whole call while ``hook_probs`` listens) when
        ``_attend`` is replaced or ``probs_bf16`` needs each row's maximum before rounding; else
        "bounded" (online softmax, nothing of size [H,S,L]; a listening ``hook_probs`` is shown
        the reference probabilities, materialised, and the output is recomputed from them only
        if the hook replaces them, so listening changes no bit)."""
        if self.prefill_path not in PREFILL_PATHS:
            raise ValueError(f"{self.__class__.__name__}.prefill_path must be one of {PREFILL_PATHS}, got {self.prefill_path!r}")
        if self.prefill_path == "dense" or self.training:
            return "dense"
        if type(self)._attend is not Attention._attend or RoundTrip.PROBS_BF16 in self.round_trips:
            return "blocked"
        return "bounded"

    @property
    def last_prefill_path(self) -> str | None:
        """The path the last prefill took ("bounded", "blocked" or "dense")."""
        return self._prefill_ran

    def materialises_probs(self) -> bool:
        """Will this prefill hold [B,H,S,L] (the dense path, or probabilities a hook listens to)?"""
        return self.prefill_choice() == "dense" or self.hook_probs.active

    def prefill(self, x: torch.Tensor, start: int, st: LayerState) -> torch.Tensor:
        """Tokens at positions start..start+S-1 (host ints) against the state; updates it."""
        B, S, _ = x.shape
        dev = x.device
        positions = torch.arange(start, start + S, device=dev)
        q_res, q, kv, cos, sin = self._q_kv(x, positions)
        W = self.window
        prior_lo = max(0, start - W + 1)
        prior_pos = torch.arange(prior_lo, start, device=dev)
        keys = torch.cat([st.kv_ring.index_select(1, prior_pos % W).to(kv.dtype), kv], dim=1)
        kpos = torch.cat([prior_pos, positions])
        path = self.prefill_choice()
        entries, selected, distill, n_entries = None, None, None, 0
        if self.compressor is not None:
            n_entries = self.compressor.prefill(x, start, st.compressor)
            entries = st.compressor.entries[:, :n_entries].to(kv.dtype)
            visible = (positions + 1) // self.ratio  # entries w < visible[t] are closed for query t
            if self.indexer is not None:
                train_ix = self.training and torch.is_grad_enabled()
                xi, qi = (x.detach(), q_res.detach()) if train_ix else (x, q_res)
                n_idx = self.indexer.compressor.prefill(xi, start, st.indexer)
                ikeys = st.indexer.entries[:, :n_idx]
                if self.indexer.enabled and n_idx > 0:
                    if train_ix:
                        iscores = self.indexer.scores(xi, qi, positions, ikeys)
                        distill = (iscores, torch.arange(n_entries, device=dev).view(1, -1) < visible.view(-1, 1))
                        if not self.indexer.train_dense:
                            selected = self.indexer.select(iscores.detach(), visible)
                    else:
                        selected = self.indexer.choose(xi, qi, positions, ikeys, visible, self.block_bytes)
        keep = min(S, W)
        st.kv_ring.index_copy_(1, positions[-keep:] % W, kv[:, -keep:].to(st.kv_ring.dtype))
        self._prefill_ran = path
        neg = torch.full((), float("-inf"), device=dev)
        zero = torch.zeros((), device=dev)

        def bias_rows(a: int, b: int) -> torch.Tensor:
            """The additive mask [B or 1, b-a, L] of queries a..b-1 over [window keys | entries]."""
            rel = positions[a:b].view(-1, 1) - kpos.view(1, -1)
            bias = torch.where((rel >= 0) & (rel < W), zero, neg).unsqueeze(0)
            if entries is None:
                return bias
            if not self.use_compressed:
                ent_bias = torch.full((B, b - a, n_entries), float("-inf"), device=dev)
            elif selected is not None:
                chosen = torch.full((B, b - a, n_entries + 1), float("-inf"), device=dev)
                idx = selected[:, a:b]
                chosen.scatter_(-1, torch.where(idx >= 0, idx, n_entries), 0.0)
                ent_bias = chosen[..., :n_entries]
            else:
                ent_ok = torch.arange(n_entries, device=dev).view(1, -1) < visible[a:b].view(-1, 1)
                ent_bias = torch.where(ent_ok, zero, neg).unsqueeze(0).expand(B, -1, -1)
            return torch.cat([bias.expand(B, -1, -1), ent_bias], dim=-1)

        if path == "bounded":
            use = entries is not None and self.use_compressed
            out = (self.kernel or bounded_attention)(q, self.sink, self.scale, W, keys, start, prior_lo,
                                    entries if use else None, self.ratio, selected if use else None,
                                    self.q_block, self.k_block, self.block_bytes)
            if self.hook_probs.active:  # shown materialised; used only if a hook replaces them
                keys = torch.cat([keys, entries], dim=1) if entries is not None else keys
                shown = self._sink_softmax(self._logits(q, keys, bias_rows(0, S)))
                probs = self.hook_probs(shown)
                if probs is not shown:
                    out = torch.matmul(probs[..., :-1].to(keys.dtype), keys.unsqueeze(1)).transpose(1, 2)
            return self._output(out, cos, sin)
        if entries is not None:
            keys = torch.cat([keys, entries], dim=1)
        if path == "dense" or self.hook_probs.active:  # the reference in one call (one hook firing)
            out = self._attend(q, keys, bias_rows(0, S))
            if distill is not None:
                L = keys.shape[1]
                self.indexer.distill(distill[0], self._last_probs[..., L - n_entries : L], distill[1])
        else:  # "blocked": the dense reference per block of queries, [B,H,rows,L] each
            rows = self.q_block or block_rows(self.block_bytes, 4 * B * self.n_heads * keys.shape[1] * 4, S)
            out = torch.cat([self._attend(q[:, a : a + rows], keys, bias_rows(a, min(S, a + rows)))
                             for a in range(0, S, rows)], dim=1)
        return self._output(out, cos, sin)

    # --------------------------------------------------------------- decode
    def decode_takes_kernel(self) -> bool:
        """Does this decode step run ``decode_kernel``? Only when one is installed, nobody listens
        to ``hook_probs`` (the kernel never materialises the probabilities), ``probs_bf16`` is off
        (the kernel's online softmax rounds against running maxima, not the row's maximum), the
        module is in eval mode and the reference math (``_attend``, ``_logits``,
        ``_sink_softmax``) is not replaced (bug-zoo variants)."""
        cls = type(self)
        return (self.decode_kernel is not None and not self.hook_probs.active and not self.training
                and RoundTrip.PROBS_BF16 not in self.round_trips
                and cls._attend is Attention._attend and cls._logits is Attention._logits
                and cls._sink_softmax is Attention._sink_softmax)

    def plain_batch_members(self) -> list[QLinear]:
        """The unquantised linears decode applies to this attention's input x, in call order: the
        compressor's wkv / wgate, the indexer compressor's, the indexer's weights_proj (when the
        indexer selects)."""
        if self.compressor is None:
            return []
        out = [self.compressor.wkv, self.compressor.wgate]
        if self.indexer is not None:
            out += [self.indexer.compressor.wkv, self.indexer.compressor.wgate]
            if self.indexer.enabled:
                out.append(self.indexer.weights_proj)
        return out

    def _offer_plain_batch(self, x: torch.Tensor) -> list[QLinear]:
        """Run ``plain_batch_members`` that can share a launch (``QLinear.batchable``: at least two)
        as one ``plain_batch_kernel`` call and ``offer`` each its output; the offered linears. Each
        output is the bits its own ``plain_kernel`` launch gives on the GPU, so hooks on a linear fire
        on the same tensor either way; a hooked compressor or indexer still calls its linears."""
        if self.plain_batch_kernel is None:
            return []
        lins, weights = [], []
        for lin in self.plain_batch_members():
            w = lin.batchable(x)
            if w is not None:
                lins.append(lin)
                weights.append(w)
        if len(lins) < 2:
            return []
        ys = self.plain_batch_kernel(x, weights)
        if ys is None:
            return []
        for lin, y in zip(lins, ys):
            lin.offer(x, y)
        return lins

    def decode(self, x: torch.Tensor, pos: torch.Tensor, st: LayerState) -> torch.Tensor:
        """One token per sequence at device position ``pos``: fixed shapes, no host branches.
        The kernel path (``decode_takes_kernel``) reads the ring and the valid entries in place;
        the reference concatenates them with an additive -inf mask (``decode_keys_bias``)."""
        positions = pos.view(1)
        fused = self.fused_rows() and getattr(self.rope_kernel, "takes_ring", False)  # hook_kv silent: kv as written
        unropes = fused and self.decode_takes_kernel() and self._decode_unropes()
        ropes_q = unropes and getattr(self.decode_kernel, "ropes_q_with", None) is self.rope_kernel  # hook_q silent
        if fused and self._forks_decode():
            q, kv, cos, sin, n_entries, selected = self._decode_on_lanes(x, pos, st, ropes_q)
            entries = st.compressor.entries.to(kv.dtype)
        else:
            if fused:
                q_res, q, kv, cos, sin = self._q_kv_fused(x, positions, ring=st.kv_ring, rope_q=not ropes_q)
            else:
                q_res, q, kv, cos, sin = self._q_kv(x, positions)
                st.kv_ring.index_copy_(1, (pos % self.window).view(1), kv.to(st.kv_ring.dtype))
            entries = n_entries = selected = None
            if self.compressor is not None:
                offered: list[QLinear] = []
                try:
                    n_entries, n_idx = self._compress(x, pos, st, offered)
                    entries = st.compressor.entries.to(kv.dtype)
                    selected = self._select(x, q_res, positions, st, n_idx)
                finally:
                    self._withdraw(offered)
        ring = st.kv_ring.to(kv.dtype)
        if self.decode_takes_kernel():
            use = entries is not None and self.use_compressed
            out = self.decode_kernel(q, self.sink, self.scale, ring, pos, entries if use else None,
                                     n_entries if use else None, selected if use else None,
                                     **({"inv_freq": self.rotary.inv_freq} if unropes else {}),
                                     **({"q_eps": self.eps} if ropes_q else {}))
        else:
            out = self._attend(q, *decode_keys_bias(ring, pos, entries, n_entries, selected, self.use_compressed))
        return self._output(out, cos, sin, unroped=unropes)

    def _offer_compressor_pairs(self, x: torch.Tensor, offered: list[QLinear]) -> None:
        """Run each compressor's wkv and wgate of x (quantised: not in the plain batch) as one
        ``quant_pair_kernel`` launch, ``offer`` each its output and append both to ``offered``. At
        V4-Pro's NVFP4 export a CSA layer's four compressor GEMVs become two launches, an HCA's one."""
        for c in (self.compressor, self.indexer.compressor if self.indexer is not None else None):
            if c is not None and c.wkv._offered is None and offer_pair(self.quant_pair_kernel, x, c.wkv, c.wgate):
                offered += [c.wkv, c.wgate]

    def _compress(self, x: torch.Tensor, pos: torch.Tensor, st: LayerState,
                  offered: list[QLinear]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The compressors' decode step, their projections first as the plain-batch launch or a
        pair launch per compressor (the linears offered so are appended to ``offered``, for the
        caller to ``_withdraw``): (n_entries, the indexer's entry count or None)."""
        offered += self._offer_plain_batch(x)
        self._offer_compressor_pairs(x, offered)
        n_entries = self.compressor.decode(x, pos, st.compressor)
        n_idx = self.indexer.compressor.decode(x, pos, st.indexer) if self.indexer is not None else None
        return n_entries, n_idx

    def _select(self, x: torch.Tensor, q_res: torch.Tensor, positions: torch.Tensor, st: LayerState,
                n_idx: torch.Tensor | None) -> torch.Tensor | None:
        """The indexer's top-k [B,1,k] over its entries, None without a selecting indexer."""
        if self.indexer is None or not self.indexer.enabled:
            return None
        return self.indexer.decode_select(x, q_res, positions, st.indexer.entries, n_idx)

    @staticmethod
    def _withdraw(offered: list) -> None:
        for lin in offered:  # an offer nobody took (a replaced method, a disabled indexer) goes
            lin.offer(None)

    def _forks_decode(self) -> bool:
        """Fork the compressors' step and the indexer's selection onto a decode lane? When lanes
        fork now (``lanes.forks_now``) and that work runs its kernels only: no hook point of it
        listens (``decode_kernel_applies``, ``decode_takes_kernel``), so no user code runs on the
        side lane and a hooked branch keeps the one-lane order of its hooks."""
        c, ix = self.compressor, self.indexer
        return (forks_now() and c is not None and c.decode_kernel is not None and c.decode_kernel_applies()
                and (ix is None or (ix.compressor.decode_kernel is not None and ix.compressor.decode_kernel_applies()
                                    and (not ix.enabled or ix.decode_takes_kernel()))))

    def _decode_on_lanes(self, x: torch.Tensor, pos: torch.Tensor, st: LayerState, ropes_q: bool) -> tuple:
        """The fused decode's q / kv path on the main lane, the compressors' step and the indexer's
        selection on the side lane (``dsv4lab.lanes``): the compressors from the fork (they read x
        only), the selection once q_res is issued, both beside wq_b; joined before attention.
        Returns (q, kv, cos, sin, n_entries, selected)."""
        fork = Fork(x.device)
        offered: list[QLinear] = []
        selected = []
        try:
            with fork.side():
                n_entries, n_idx = self._compress(x, pos, st, offered)

            def select(q_res: torch.Tensor) -> None:
                with fork.side(after_main=True):
                    selected.append(self._select(x, q_res, pos.view(1), st, n_idx))

            _, q, kv, cos, sin = self._q_kv_fused(x, pos.view(1), ring=st.kv_ring, rope_q=not ropes_q,
                                                  with_q_res=select)
        finally:
            self._withdraw(offered)
            fork.join()
        return q, kv, cos, sin, n_entries, selected[0]

    def _decode_unropes(self) -> bool:
        """Does ``decode_kernel`` take the output's inverse RoPE over (``inv_freq=``: one launch
        less)? When it declares this ``rope_kernel``'s results (``unropes_with``) and ``_output`` is
        stock; the caller checks the fused rows' path. It may then also take wq_b's raw q and
        normalise + rotate it (``q_eps=``, declared by ``ropes_q_with``: one launch less again)."""
        return (getattr(self.decode_kernel, "unropes_with", None) is self.rope_kernel
                and type(self)._output is Attention._output)
