"""Lightning indexer (CSA layers): picks, per query, the top-k compressed entries to attend.

score[t, s] = sum_h w[t,h] * ReLU(q[t,h] . K[s]) / sqrt(index_head_dim), with
w = weights_proj(x) / sqrt(index_n_heads), q = RoPE(wq_b(q_residual)) (compress theta, no norm)
and K the indexer's own compressed keys (a CSA-style compressor at index_head_dim). Keys are one
shared set for all heads. Entries not yet closed for a query (s >= (t+1)//ratio) are excluded;
selections past the valid range come back as -1.

``indexer_fp4`` (DeepSeek's reference): q after RoPE and the keys (the compressor's entries)
are rotated by a normalised Walsh-Hadamard transform and round-tripped through FP4 per 32 with
power-of-two scales; the scores use the rotated, rounded q and k.
"""
from __future__ import annotations

import torch

from ..config import DSV4Config
from ..quant.modes import RoundTrip
from .bounded_attention import block_rows
from .component import Component
from .compressor import Compressor
from .hooks import HookPoint
from .linear import QLinear
from .rope import Rotary, apply_rope
from .roundtrips import indexer_fp4_round_trip


class Indexer(Component):
    ROUND_TRIPS = (RoundTrip.INDEXER_FP4,)  # q here, k in its compressor (set together)

    def __init__(self, config: DSV4Config, ratio: int) -> None:
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.topk = config.index_topk
        self.ratio = ratio
        self.wq_b = QLinear(config.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = QLinear(config.hidden_size, self.n_heads)
        self.compressor = Compressor(config, self.head_dim, ratio, overlap=True, rotate=True)
        self.round_trips: frozenset = frozenset()  # of RoundTrip; set by dsv4lab.precision
        self.rotary = Rotary(config, "compress")
        self.enabled = True
        self.decode_kernel = None  # optional decode scores with index_scores_decode's signature (dsv4lab.kernels)
        self.prefill_kernel = None  # optional prefill scores with index_scores_prefill's signature (dsv4lab.kernels)
        self.rope_kernel = None    # optional queries' RoPE with norm_rope_ref's signature (dsv4lab.kernels)
        self.topk_kernel = None    # optional decode top-k with index_top_k_decode's signature (dsv4lab.kernels)
        self.train_dense = False  # training: attend every closed entry while the indexer distils
        self.aux_loss: torch.Tensor | None = None
        self.hook_q = HookPoint("indexer queries [B,S,Hi,Ih] after RoPE")
        self.hook_scores = HookPoint("index scores [B,S,T] (fp32, -inf for not-yet-closed entries)")
        self.hook_indices = HookPoint("chosen entries [B,S,k] (long, -1 = none)")

    def queries(self, q_res: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """q [B,S,Hi,Ih] after RoPE (and ``indexer_fp4``); fires ``hook_q``."""
        B, S, _ = q_res.shape
        q = self.wq_b(q_res).view(B, S, self.n_heads, self.head_dim)
        if self.rope_takes_kernel():
            q = self.rope_kernel(q, positions, self.rotary.inv_freq)
        else:
            cos, sin = self.rotary(positions)
            q = apply_rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2))
        if RoundTrip.INDEXER_FP4 in self.round_trips:
            q = indexer_fp4_round_trip(q)
        return self.hook_q(q)

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """w [B,S,Hi] (fp32) = weights_proj(x) / sqrt(Hi)."""
        return self.weights_proj(x).float() * self.n_heads ** -0.5

    def combine(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """scores [B,S,T] from q [B,S,Hi,Ih], w [B,S,Hi], keys [B,T,Ih]; transient [B,S,Hi,T] fp32."""
        return index_scores(q, w, keys)

    def scores(self, x: torch.Tensor, q_res: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return self.combine(self.queries(q_res, positions), self.head_weights(x), keys)

    def choose(self, x: torch.Tensor, q_res: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
               visible: torch.Tensor, block_bytes: int) -> torch.Tensor:
        """Prefill top-k [B,S,k] = ``select(scores(...), visible)``, computed per block of queries
        so the [B, rows, Hi, T] fp32 transient stays within ``block_bytes`` (x2 for the product).
        Whole when an indexer hook listens (its one firing sees every query, as documented).
        A replaced ``scores`` / ``select`` runs per block (they are row-wise). Each row's scores
        are the same dot products as in the whole call (the same indices, bitwise on the CPU)."""
        B, S, _ = x.shape
        if self.prefill_takes_kernel():  # [B, rows, T] scores only: the kernel keeps [.., Hi, T] on chip
            q, w_raw = self.queries(q_res, positions), self.weights_proj(x)
            rows = block_rows(block_bytes, B * keys.shape[1] * 4 * 3, S)  # scores, masked copy, top-k's sort
            return torch.cat([self.select(self.prefill_kernel(q[:, a:a + rows], w_raw[:, a:a + rows], keys,
                                                              visible[a:a + rows], self.n_heads ** -0.5),
                                          visible[a:a + rows]) for a in range(0, S, rows)], 1)
        rows = block_rows(block_bytes, B * self.n_heads * keys.shape[1] * 4 * 2, S)
        if rows >= S or self.hook_q.active or self.hook_scores.active or self.hook_indices.active:
            return self.select(self.scores(x, q_res, positions, keys), visible)
        if type(self).scores is Indexer.scores:
            q, w, kf = self.queries(q_res, positions), self.head_weights(x), keys.float()  # fp32 keys once

            def part(a: int, b: int) -> torch.Tensor:
                return self.combine(q[:, a:b], w[:, a:b], kf)
        else:
            def part(a: int, b: int) -> torch.Tensor:
                return self.scores(x[:, a:b], q_res[:, a:b], positions[a:b], keys)
        return torch.cat([self.select(part(a, min(S, a + rows)), visible[a : a + rows]) for a in range(0, S, rows)], 1)

    def rope_takes_kernel(self) -> bool:
        """Does ``queries`` rotate with ``rope_kernel`` (one launch for the reference's ~14: angles,
        cos/sin, the fp32 rotation, stack, cast, cat)? Installed, ``hook_q`` not listening, the
        rotary stock, not training with grad (the kernel has no backward)."""
        return (self.rope_kernel is not None and not self.hook_q.active and type(self.rotary).forward is Rotary.forward
                and not (self.training and torch.is_grad_enabled()))

    def _stock_scoring(self) -> bool:
        """No indexer hook listens (a kernel's scores differ from the reference's in summation
        order) and the scoring math (``scores``, ``combine``, ``head_weights``) is not replaced."""
        cls = type(self)
        return (not (self.hook_q.active or self.hook_scores.active or self.hook_indices.active)
                and cls.scores is Indexer.scores and cls.combine is Indexer.combine and cls.head_weights is Indexer.head_weights)

    def decode_takes_kernel(self) -> bool:
        """Does decode score with ``decode_kernel``? Installed and the scoring stock (``_stock_scoring``)."""
        return self.decode_kernel is not None and self._stock_scoring()

    def prefill_takes_kernel(self) -> bool:
        """Does ``choose`` score with ``prefill_kernel``? Installed, the scoring stock, and not training
        with grad (the kernel has no backward)."""
        return (self.prefill_kernel is not None and self._stock_scoring()
                and not (self.training and torch.is_grad_enabled()))

    def decode_select(self, x: torch.Tensor, q_res: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
                      n_valid: torch.Tensor) -> torch.Tensor:
        """Decode top-k [B,1,k] over the entries w < ``n_valid`` (a 0-d device tensor) of keys
        [B,T,Ih]: ``select(scores(...))``, the scores from ``decode_kernel`` when it applies
        (``decode_takes_kernel``; it takes weights_proj(x) unscaled and folds the 1/sqrt(Hi))."""
        if not self.decode_takes_kernel():
            return self.select(self.scores(x, q_res, positions, keys), n_valid.view(1))
        if self._decode_ropes_q():  # wq_b's raw q; the scores kernel rotates it (hook_q silent: _stock_scoring)
            B = q_res.shape[0]
            scores = self.decode_kernel(self.wq_b(q_res).view(B, 1, self.n_heads, self.head_dim), self.weights_proj(x),
                                        keys, n_valid, self.n_heads ** -0.5, positions=positions,
                                        inv_freq=self.rotary.inv_freq)
        else:
            scores = self.decode_kernel(self.queries(q_res, positions), self.weights_proj(x), keys, n_valid,
                                        self.n_heads ** -0.5)
        if self.topk_kernel is not None and type(self).select is Indexer.select:
            return self.topk_kernel(scores, n_valid, self.topk)
        return self.select(scores, n_valid.view(1))

    def _decode_ropes_q(self) -> bool:
        """Does ``decode_kernel`` take wq_b's raw q and rotate it (``positions=`` / ``inv_freq=``: one
        launch less)? When it declares this ``rope_kernel``'s result (``ropes_q_with``), the RoPE runs
        on the kernel path (``rope_takes_kernel``), ``queries`` is stock and no ``indexer_fp4`` round
        trip comes after the RoPE."""
        return (getattr(self.decode_kernel, "ropes_q_with", None) is self.rope_kernel and self.rope_takes_kernel()
                and type(self).queries is Indexer.queries and RoundTrip.INDEXER_FP4 not in self.round_trips)

    def select(self, scores: torch.Tensor, n_valid_for_query: torch.Tensor) -> torch.Tensor:
        """Top-k valid entries per query; scores [B,S,T], n_valid [S] -> indices [B,S,k]."""
        return self.hook_indices(top_k_valid(self.hook_scores(mask_closed_later(scores, n_valid_for_query)),
                                             n_valid_for_query, self.topk))

    def distill(self, scores: torch.Tensor, attn_probs: torch.Tensor, valid: torch.Tensor) -> None:
        """Training only: KL(main attention over the entries, summed over heads || softmax of
        the index scores), as DeepSeek trains its lightning indexer; stored in ``aux_loss``.
        scores [B,S,T]; attn_probs [B,H,S,T]; valid [S,T]."""
        target = attn_probs.detach().float().sum(1) * valid
        mass = target.sum(-1, keepdim=True)
        rows = (mass.squeeze(-1) > 1e-6) & (valid.sum(-1) > 1).unsqueeze(0)
        target = target / mass.clamp_min(1e-9)
        logp = torch.log_softmax(scores.masked_fill(~valid, -1e9), dim=-1)
        kl = (target * (torch.log(target.clamp_min(1e-9)) - logp)).masked_fill(~valid, 0).sum(-1)
        self.aux_loss = (kl * rows).sum() / rows.sum().clamp_min(1)


def mask_closed_later(scores: torch.Tensor, n_valid_for_query: torch.Tensor) -> torch.Tensor:
    """scores [B,S,T] with -inf at the entries t >= n_valid[s] (not yet closed for query s)."""
    valid = torch.arange(scores.shape[-1], device=scores.device).view(1, 1, -1) < n_valid_for_query.view(1, -1, 1)
    return scores.masked_fill(~valid, float("-inf"))


def top_k_valid(masked: torch.Tensor, n_valid_for_query: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [B,S,min(k,T)] of the largest of the masked scores [B,S,T], -1 past n_valid[s]."""
    idx = masked.topk(min(k, masked.shape[-1]), dim=-1).indices
    return torch.where(idx < n_valid_for_query.view(1, -1, 1), idx, torch.full_like(idx, -1))


def index_top_k_decode(scores: torch.Tensor, n_valid: torch.Tensor, k: int) -> torch.Tensor:
    """Decode top-k [B,1,min(k,T)] of scores [B,1,T] over the entries t < ``n_valid`` (a 0-d device
    tensor), -1 where fewer are valid: ``Indexer.select`` without its hooks. The reference of
    ``dsv4lab.kernels.indexer_topk`` (``Indexer.topk_kernel``; the kernel returns the same set
    for distinct scores, in index order)."""
    n = n_valid.view(1)
    return top_k_valid(mask_closed_later(scores, n), n, k)


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """scores [B,S,T] = sum_h w[h] * ReLU(q[h] . k) / sqrt(Ih) from q [B,S,Hi,Ih], w [B,S,Hi] (fp32),
    keys [B,T,Ih], all in fp32 (transient [B,S,Hi,T])."""
    s = torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(1))  # [B,S,H,T]
    s = torch.relu(s) * q.shape[-1] ** -0.5
    return (s * w.unsqueeze(-1)).sum(dim=2)


def index_scores_decode(q: torch.Tensor, w_raw: torch.Tensor, keys: torch.Tensor, n_valid: torch.Tensor,
                        w_scale: float) -> torch.Tensor:
    """Decode scores [B,1,T] (fp32, -inf at t >= n_valid) of q [B,1,Hi,Ih] over keys [B,T,Ih], with
    head weights w_raw [B,1,Hi] * w_scale (in fp32, as ``Indexer.head_weights``); n_valid a 0-d
    device tensor. The reference of ``dsv4lab.kernels.indexer_decode`` (``Indexer.decode_kernel``)."""
    s = index_scores(q, w_raw.float() * w_scale, keys)
    return s.masked_fill(torch.arange(keys.shape[1], device=keys.device) >= n_valid, float("-inf"))


def index_scores_prefill(q: torch.Tensor, w_raw: torch.Tensor, keys: torch.Tensor, n_valid: torch.Tensor,
                         w_scale: float) -> torch.Tensor:
    """Prefill scores [B,S,T] (fp32, -inf at t >= n_valid[s]) of q [B,S,Hi,Ih] over keys [B,T,Ih], with
    head weights w_raw [B,S,Hi] * w_scale (in fp32, as ``Indexer.head_weights``); n_valid [S]. The
    reference of ``dsv4lab.kernels.indexer_prefill`` (``Indexer.prefill_kernel``)."""
    return mask_closed_later(index_scores(q, w_raw.float() * w_scale, keys), n_valid)
