"""Manifold-constrained hyper-connections (mHC): hc_mult residual streams per token.

Per site: RMS-normalised flattened streams -> linear ``fn`` -> split into pre [hc], post [hc],
comb [hc, hc] logits (in that order); pre = sigmoid(.)+eps, post = 2*sigmoid(.), comb =
Sinkhorn(softmax(.)+eps). The block input is sum_j pre_j * stream_j; the new streams are
post_k * block_out + sum_j comb[j, k] * stream_j (comb used TRANSPOSED).

The math is in the functions ``mix_weights`` / ``collapse`` / ``head_weights`` (the reference the
fused kernels of ``dsv4lab.kernels.mhc_fused`` are checked against); the components add the hook
points and the ``kernel`` slots: ``HyperConnection.kernel`` (mixes + collapse in one call),
``HyperConnection.post_kernel`` (the expansion), ``HyperHead.kernel``. A slot is used only while
none of the component's hook points listens and the method it replaces is the reference's, so
hooks and overriding implementations (docs/components.md) always see the reference path. The
decoder asks a site for ``norm(collapsed)`` (``HyperConnection.forward_normed``): one launch where
the kernel declares the norm's slot (``folds_norm``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import DSV4Config
from .component import Component, module_hooks_listen
from .hooks import HookPoint
from .norms import RMSNorm, unweighted_rms_norm


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Doubly-stochastic projection as the reference does it: softmax rows (+eps) first."""
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def mix_logits(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
               norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [B,S,hc,D] -> (pre [B,S,hc], post [B,S,hc], comb's logits [B,S,hc,hc]), all fp32:
    ``mix_weights`` before the Sinkhorn."""
    hc = streams.shape[-2]
    flat = unweighted_rms_norm(streams.flatten(start_dim=2).float(), norm_eps)
    pre_w, post_w, comb_w = F.linear(flat, fn.float()).split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    s_pre, s_post, s_comb = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * s_pre + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * s_post + post_b)
    return pre, post, comb_w.unflatten(-1, (hc, hc)) * s_comb + comb_b.view(hc, hc)


def mix_weights(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [B,S,hc,D] -> (pre [B,S,hc], post [B,S,hc], comb [B,S,hc,hc]), all fp32."""
    pre, post, logits = mix_logits(streams, fn, base, scale, hc_eps, norm_eps)
    return pre, post, sinkhorn(logits, iters, hc_eps)


@dataclass(frozen=True)
class PendingSinkhorn:
    """comb's logits [B,S,hc,hc] (fp32) whose Sinkhorn the expansion runs: what
    ``HyperConnection.forward`` hands to ``combine`` when both fused launches run
    (``defers_sinkhorn``). The fused expansion then projects in its PDL prologue, under the
    block's last kernel, instead of on hc_pre's critical path (~2 us a decode site)."""

    logits: torch.Tensor
    iters: int
    eps: float

    def resolve(self) -> torch.Tensor:
        """The doubly stochastic comb (``sinkhorn``), for a reference expansion."""
        return sinkhorn(self.logits, self.iters, self.eps)


def collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """Block input sum_j pre_j * stream_j [B,S,D]: fp32 products and sum, one cast to streams.dtype."""
    return (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)


def head_weights(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
                 norm_eps: float) -> torch.Tensor:
    """HyperHead's collapse weights [B,S,hc] (fp32) for streams [B,S,hc,D]."""
    flat = unweighted_rms_norm(streams.flatten(2).float(), norm_eps)
    return torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + eps


class HyperConnection(Component):
    """One mHC site (attention or FFN): computes pre/post/comb and collapses the streams."""

    def __init__(self, config: DSV4Config) -> None:
        super().__init__()
        hc = config.hc_mult
        self.hc = hc
        self.iters = config.hc_sinkhorn_iters
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        mix = (2 + hc) * hc
        self.fn = nn.Parameter(torch.zeros(mix, hc * config.hidden_size))
        self.base = nn.Parameter(torch.zeros(mix))
        self.scale = nn.Parameter(torch.ones(3))
        self.hook_pre = HookPoint("stream collapse weights [B,S,hc] (fp32)")
        self.hook_post = HookPoint("block-output placement weights [B,S,hc] (fp32, in [0,2])")
        self.hook_comb = HookPoint("Sinkhorn stream mixer [B,S,hc,hc] (fp32, doubly stochastic)")
        self.hook_collapsed = HookPoint("collapsed block input [B,S,D]")
        self.hook_streams = HookPoint("new residual streams after this site [B,S,hc,D]")
        # optional fused implementations (dsv4lab.kernels.install), used while no hook listens:
        # kernel(streams, fn, base, scale, iters, hc_eps, norm_eps) -> (pre, post, comb, collapsed)
        self.kernel = None
        # post_kernel(streams, block_out, post, comb) -> new streams (the expansion)
        self.post_kernel = None

    def hooked(self) -> bool:
        """Does any hook point of this site listen? (then the reference runs, kernels or not)"""
        m = self._modules  # submodules read from their dict: no nn.Module.__getattr__ call each
        return (m["hook_pre"].active or m["hook_post"].active or m["hook_comb"].active or m["hook_collapsed"].active
                or m["hook_streams"].active)  # no generator: asked 4 times an eager layer

    def mixes(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pre, post, comb = mix_weights(streams, self.fn, self.base, self.scale, self.iters, self.hc_eps, self.norm_eps)
        return self.hook_pre(pre), self.hook_post(post), self.hook_comb(comb)

    def defers_sinkhorn(self) -> bool:
        """Does the fused path hand ``combine`` a ``PendingSinkhorn``? Only when both slots take one
        (``takes_pending_sinkhorn``: the fused pair of ``dsv4lab.kernels``), the expansion is the
        reference's and no torch hook on this module would see the forward's outputs."""
        return (getattr(self.kernel, "takes_pending_sinkhorn", False)
                and getattr(self.post_kernel, "takes_pending_sinkhorn", False)
                and type(self).expand is HyperConnection.expand and type(self).combine is HyperConnection.combine
                and not module_hooks_listen(self))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | PendingSinkhorn, torch.Tensor]:
        """streams [B,S,hc,D] -> (post, comb, collapsed [B,S,D]); comb is a ``PendingSinkhorn``
        where ``defers_sinkhorn`` (``combine`` takes either)."""
        if self.kernel is not None and type(self).mixes is HyperConnection.mixes and not self.hooked():
            return self._pre_kernel(streams)
        pre, post, comb = self.mixes(streams)
        return post, comb, self.hook_collapsed(collapse(pre, streams))

    def forward_normed(self, streams: torch.Tensor, norm: RMSNorm
                       ) -> tuple[torch.Tensor, torch.Tensor | PendingSinkhorn, torch.Tensor]:
        """(post, comb, norm(collapsed)): the layer's ``self(streams)`` then its RMSNorm, in one
        launch where ``folds_norm(norm)`` (the collapsed rows never leave the kernel's last program)."""
        if not self.folds_norm(norm):
            post, comb, collapsed = self(streams)
            return post, comb, norm(collapsed)
        return self._pre_kernel(streams, block_norm_weight=norm.weight, block_norm_eps=norm.eps)

    def _pre_kernel(self, streams: torch.Tensor, **norm_kw) -> tuple[torch.Tensor, torch.Tensor | PendingSinkhorn,
                                                                    torch.Tensor]:
        """(post, comb or its ``PendingSinkhorn``, the collapsed rows, normed where ``norm_kw`` gives
        the block norm) from the installed hc_pre kernel: the one launch of ``forward`` and
        ``forward_normed``."""
        defer = self.defers_sinkhorn()
        _, post, comb, rows = self.kernel(streams, self.fn, self.base, self.scale, self.iters, self.hc_eps,
                                          self.norm_eps, **({"sinkhorn": False} if defer else {}), **norm_kw)
        return post, (PendingSinkhorn(comb, self.iters, self.hc_eps) if defer else comb), rows

    def folds_norm(self, norm: RMSNorm) -> bool:
        """Does this site's kernel also run ``norm`` on its collapsed rows (``block_norm_weight=``)?
        Only where the kernel path runs here (no hook point listens, ``mixes`` and ``forward`` are
        the reference's, no torch hook on the site) and it declares ``norm``'s slot (``norms_with``),
        which is the stock RMSNorm with no torch hook and not training with grad."""
        nk = norm.kernel
        return (nk is not None and getattr(self.kernel, "norms_with", None) is nk
                and type(self).mixes is HyperConnection.mixes and type(self).forward is HyperConnection.forward
                and type(norm).forward is RMSNorm.forward and not self.hooked()
                and not (norm.training and torch.is_grad_enabled())
                and not module_hooks_listen(self) and not module_hooks_listen(norm))

    def combine(self, streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor,
                comb: torch.Tensor | PendingSinkhorn) -> torch.Tensor:
        """Instance entry point of the expansion (implementations may override ``expand``)."""
        pending = type(comb) is PendingSinkhorn
        if self.post_kernel is not None and type(self).expand is HyperConnection.expand and not self.hooked():
            if pending:  # the block's launches ran since hc_pre wrote the logits: hc_post may read them early
                return self.post_kernel(streams, block_out, post, comb.logits, sinkhorn_iters=comb.iters,
                                        hc_eps=comb.eps, logits_settled=True)
            return self.post_kernel(streams, block_out, post, comb)
        if pending:  # a hook started listening since forward: the reference projection, then expand
            comb = comb.resolve()
        return self.hook_streams(self.expand(streams, block_out, post, comb))

    def combine_then(self, streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor,
                     comb: torch.Tensor | PendingSinkhorn, nxt: "HyperConnection", norm: RMSNorm
                     ) -> tuple[torch.Tensor, tuple] | None:
        """``combine`` and then ``nxt.forward_normed(new streams, norm)`` as one launch: (new streams,
        (post, comb, normed) of nxt), the same bits as the two. Only where this site's expansion runs
        its kernel (no hook point of it listens, ``expand`` / ``combine`` stock), nxt folds ``norm``
        (``folds_norm``: its kernel path, no hook of it or the norm) and the expansion kernel declares
        nxt's pre slot (``pre_fuses_with``); None otherwise, or where the kernel declines the shape
        (the caller then runs the two calls). Why: the decode layer's attn expansion and ffn pre are
        two dependent launches over the same streams (docs/kernels.md)."""
        pk = self.post_kernel
        then_pre = getattr(pk, "then_pre", None)
        if (then_pre is None or getattr(pk, "pre_fuses_with", None) is not nxt.kernel
                or type(self).expand is not HyperConnection.expand or type(self).combine is not HyperConnection.combine
                or self.hooked() or not nxt.folds_norm(norm)):
            return None
        pending = type(comb) is PendingSinkhorn
        defer = nxt.defers_sinkhorn()
        got = then_pre(streams, block_out, post, comb.logits if pending else comb, nxt.fn, nxt.base, nxt.scale,
                       nxt.iters, nxt.hc_eps, nxt.norm_eps, sinkhorn_iters=comb.iters if pending else 0,
                       post_eps=comb.eps if pending else 0.0, logits_settled=pending, sinkhorn=not defer,
                       block_norm_weight=norm.weight, block_norm_eps=norm.eps)
        if got is None:
            return None
        new_streams, _, post2, comb2, rows = got
        return new_streams, (post2, PendingSinkhorn(comb2, nxt.iters, nxt.hc_eps) if defer else comb2, rows)

    @staticmethod
    def expand(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """New streams: post_k * out + sum_j comb[j,k] stream_j (comb transposed)."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(Component):
    """Final collapse of the hc streams before the output norm and head."""

    def __init__(self, config: DSV4Config) -> None:
        super().__init__()
        hc = config.hc_mult
        self.eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros(hc, hc * config.hidden_size))
        self.base = nn.Parameter(torch.zeros(hc))
        self.scale = nn.Parameter(torch.ones(1))
        self.hook_pre = HookPoint("final collapse weights [B,S,hc] (fp32)")
        # optional fused implementation (dsv4lab.kernels.install), used while hook_pre does not listen:
        # kernel(streams, fn, base, scale, eps, norm_eps) -> (pre, collapsed)
        self.kernel = None

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and not self.hook_pre.active:
            return self.kernel(streams, self.fn, self.base, self.scale, self.eps, self.norm_eps)[1]
        pre = self.hook_pre(head_weights(streams, self.fn, self.base, self.scale, self.eps, self.norm_eps))
        return collapse(pre, streams)
