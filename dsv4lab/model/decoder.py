"""One DSV4 decoder layer: mHC around attention, mHC around the MoE."""
from __future__ import annotations

import torch

from ..config import DSV4Config
from .attention import Attention
from .component import Component
from .hooks import HookPoint
from .mhc import HyperConnection, PendingSinkhorn
from .moe import MoE
from .norms import RMSNorm
from .state import LayerState


class DecoderLayer(Component):
    def __init__(self, config: DSV4Config, layer: int) -> None:
        super().__init__()
        self.index = layer
        self.attn_hc = HyperConnection(config)
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer)
        self.ffn_hc = HyperConnection(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoE(config, layer)
        self.hook_resid_pre = HookPoint("residual streams entering the layer [B,S,hc,D]")
        self.hook_resid_mid = HookPoint("residual streams after attention [B,S,hc,D]")
        self.hook_resid_post = HookPoint("residual streams leaving the layer [B,S,hc,D]")

    def _ffn(self, h: torch.Tensor, input_ids: torch.Tensor | None, graph_safe: bool, entered: tuple | None = None,
             nxt: DecoderLayer | None = None) -> tuple[torch.Tensor, tuple | None]:
        """The FFN half: (streams leaving the layer, nxt's attention entry or None). ``entered``: its
        site's (post, comb, normed x), already computed with the attention's expansion
        (``_attn_out``); ``nxt``: the next layer on this device, whose attention pre the FFN's
        expansion runs in the same launch where nothing hooks between them."""
        h = self.hook_resid_mid(h)
        post, comb, x = entered if entered is not None else self.ffn_hc.forward_normed(h, self.ffn_norm)
        out = self.mlp(x, input_ids, graph_safe)
        if nxt is not None and not self.hook_resid_post.active and not nxt.hook_resid_pre.active:
            fused = self.ffn_hc.combine_then(h, out, post, comb, nxt.attn_hc, nxt.attn_norm)
            if fused is not None:
                return fused
        return self.hook_resid_post(self.ffn_hc.combine(h, out, post, comb)), None

    def _attn_out(self, h: torch.Tensor, a: torch.Tensor, post: torch.Tensor, comb: torch.Tensor | PendingSinkhorn,
                  input_ids: torch.Tensor | None, graph_safe: bool, nxt: DecoderLayer | None = None
                  ) -> tuple[torch.Tensor, tuple | None]:
        """The attention's expansion, then the FFN half: in one launch with the FFN site's pre where
        nothing hooks between them (``HyperConnection.combine_then``)."""
        if not self.hook_resid_mid.active:
            fused = self.attn_hc.combine_then(h, a, post, comb, self.ffn_hc, self.ffn_norm)
            if fused is not None:
                return self._ffn(fused[0], input_ids, graph_safe, entered=fused[1], nxt=nxt)
        return self._ffn(self.attn_hc.combine(h, a, post, comb), input_ids, graph_safe, nxt=nxt)

    def prefill(self, h: torch.Tensor, input_ids: torch.Tensor | None, start: int, st: LayerState) -> torch.Tensor:
        h = self.hook_resid_pre(h)
        post, comb, x = self.attn_hc.forward_normed(h, self.attn_norm)
        a = self.attn.prefill(x, start, st)
        return self._attn_out(h, a, post, comb, input_ids, graph_safe=False)[0]

    def decode(self, h: torch.Tensor, input_ids: torch.Tensor | None, pos: torch.Tensor, st: LayerState) -> torch.Tensor:
        return self.decode_then(h, input_ids, pos, st)[0]

    def decode_then(self, h: torch.Tensor, input_ids: torch.Tensor | None, pos: torch.Tensor, st: LayerState,
                    entered: tuple | None = None, nxt: DecoderLayer | None = None) -> tuple[torch.Tensor, tuple | None]:
        """``decode`` chained across layers: (streams leaving, nxt's attention entry or None).
        ``entered``: this layer's attention (post, comb, normed x), computed in the previous layer's
        last launch (its hook_resid_pre then did not listen); ``nxt``: the next layer on the same
        device. Why: a layer's FFN expansion and the next layer's attention pre are two dependent
        launches over the same streams, one where nothing hooks between them (docs/kernels.md)."""
        h = self.hook_resid_pre(h)
        post, comb, x = entered if entered is not None else self.attn_hc.forward_normed(h, self.attn_norm)
        a = self.attn.decode(x, pos, st)
        return self._attn_out(h, a, post, comb, input_ids, graph_safe=True, nxt=nxt)
