"""Known-bug implementations: each a subclass of the real component overriding the minimum.

They are built from the original module by ``dsv4lab.analysis.components.replace`` (a shallow
clone sharing its weights and hook points), so a buggy run keeps every hook name. Where the
reference method is long, the copy below differs from it only on the line marked ``# BUG``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.attention import Attention
from ..model.compressor import Compressor
from ..model.indexer import Indexer
from ..model.linear import QLinear
from ..model.mhc import HyperConnection, sinkhorn
from ..model.moe import Expert, Router, SharedExpert, score_fn
from ..model.norms import unweighted_rms_norm
from ..model.rope import Rotary, apply_rope
from ..model.state import CompressorState
from ..model.swiglu import clamped_swiglu
from ..quant.activations import NVFP4_GS_DENOM, fake_quant_nvfp4
from ..quant.fp4 import NVFP4_BLOCK, nvfp4_dequantize_blocks
from ..quant.weights import FP8BlockWeight


# ------------------------------------------------------------------------------ compressor
class CompressorApeOnKV(Compressor):
    """Position bias ``ape`` added to the KV content C as well as to the gate logits Z."""

    def project(self, x, slot_in_window):
        kv, gate = super().project(x, slot_in_window)
        return kv + self.ape.to(kv.dtype).index_select(0, slot_in_window), gate  # BUG


def compressor_prefill(mod: Compressor, x: torch.Tensor, start: int, st: CompressorState,
                       close_early: bool = False, pad_gate: float = float("-inf")) -> int:
    """Compressor.prefill with two field bugs as parameters (the defaults reproduce the
    reference bit for bit): ``close_early`` counts a window as closed one token before its last
    one (``(start+S+1)//m``) and left-pads the then too short slot list to whole windows;
    ``pad_gate`` is the gate of the missing slots before position 0 (CSA window 0's Ca half)."""
    B, S, _ = x.shape
    m, R = mod.ratio, st.ring_kv.shape[1]
    pos = torch.arange(start, start + S, device=x.device)
    kv, gate = mod.project(x, pos % m)
    w_first, w_last = start // m, (start + S + int(close_early)) // m - 1  # BUG when close_early
    if w_last >= w_first:
        lo = (w_first - 1) * m
        hi = (w_last + 1) * m
        pieces_kv, pieces_gate = [], []
        n_pad = max(0, -lo)
        if n_pad:
            pieces_kv.append(kv.new_zeros(B, n_pad, kv.shape[-1]))
            pieces_gate.append(gate.new_full((B, n_pad, gate.shape[-1]), pad_gate))  # BUG unless -inf
        ring_lo = max(lo, 0)
        if ring_lo < start:
            slots = torch.arange(ring_lo, start, device=x.device) % R
            pieces_kv.append(st.ring_kv.index_select(1, slots).to(kv.dtype))
            pieces_gate.append(st.ring_gate.index_select(1, slots))
        pieces_kv.append(kv[:, : hi - start])
        pieces_gate.append(gate[:, : hi - start])
        short = (-sum(p.shape[1] for p in pieces_kv)) % m
        if short:  # BUG: only reached with close_early; the padding goes in FRONT and shifts every window
            pieces_kv.insert(0, kv.new_zeros(B, short, kv.shape[-1]))
            pieces_gate.insert(0, gate.new_full((B, short, gate.shape[-1]), float("-inf")))
        ext_kv = torch.cat(pieces_kv, 1).unflatten(1, (-1, m))
        ext_gate = torch.cat(pieces_gate, 1).unflatten(1, (-1, m))
        kv_s, gate_s = mod._slots(ext_kv[:, 1:], ext_gate[:, 1:], ext_kv[:, :-1], ext_gate[:, :-1])
        widx = torch.arange(w_first, w_last + 1, device=x.device)
        n_fit = min(w_last + 1, st.entries.shape[1]) - w_first  # the early entry may not fit the buffer
        st.entries[:, w_first : w_first + n_fit] = mod.pool(kv_s, gate_s, widx)[:, :n_fit].to(st.entries.dtype)
    keep = min(S, R)
    slots = pos[-keep:] % R
    st.ring_kv.index_copy_(1, slots, kv[:, -keep:].to(st.ring_kv.dtype))
    st.ring_gate.index_copy_(1, slots, gate[:, -keep:])
    return (start + S) // m


class CompressorWindowOffByOne(Compressor):
    """A window counts as closed one token early ((start+S+1)//m): only a prompt that ends one
    token short of a window boundary (S = m-1 mod m) takes the wrong branch, whose slot list is
    then one short and gets padded at the front, shifting every window by one token."""

    def prefill(self, x, start, st):
        return compressor_prefill(self, x, start, st, close_early=True)


class CompressorUninitFirstEntry(Compressor):
    """CSA window 0 pools the Ca half of a window that does not exist: the never-written slots
    are read as they are (value 0, gate 0) instead of being masked out (gate -inf)."""

    def prefill(self, x, start, st):
        return compressor_prefill(self, x, start, st, pad_gate=0.0)


# ------------------------------------------------------------------------------ rope
class RotaryMainTheta(Rotary):
    """A compressed layer's rotary built with the main ``rope_theta`` instead of
    ``compress_rope_theta`` (the inverse frequencies are set by the bug's ``arm``: they need the
    config)."""


# ------------------------------------------------------------------------------ experts
def _swiglu(mod, x, clamp_after_silu=False, swap_w1_w3=False):
    gate_lin, up_lin = (mod.w3, mod.w1) if swap_w1_w3 else (mod.w1, mod.w3)
    if not clamp_after_silu:
        return mod.w2(clamped_swiglu(gate_lin(x), up_lin(x), mod.limit))
    act = F.silu(gate_lin(x)).clamp(max=mod.limit)  # BUG: clamps silu(gate), not gate
    up = up_lin(x).clamp(min=-mod.limit, max=mod.limit)
    return mod.w2(act * up)


class ExpertClampAfterSilu(Expert):
    def forward(self, x):
        return _swiglu(self, x, clamp_after_silu=True)


class SharedExpertClampAfterSilu(SharedExpert):
    def forward(self, x):
        return self.hook_out(_swiglu(self, x, clamp_after_silu=True))


class SharedExpertNoClamp(SharedExpert):
    """Shared expert as a plain SwiGLU: neither the gate (max=limit) nor the up (+-limit) clamp."""

    def forward(self, x):
        return self.hook_out(self.w2(F.silu(self.w1(x)) * self.w3(x)))  # BUG: no clamps


class ExpertW1W3Swapped(Expert):
    """gate/up halves of a fused gate_up weight read the wrong way round (w1 <-> w3)."""

    def forward(self, x):
        return _swiglu(self, x, swap_w1_w3=True)


# ------------------------------------------------------------------------------ mHC
def sinkhorn_from_exp(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    comb = torch.exp(logits)  # BUG: the reference starts from softmax(logits) + eps
    for _ in range(iters):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def mhc_mixes(mod: HyperConnection, streams, order=("pre", "post", "comb"), sinkhorn_fn=sinkhorn, pre_eps=True):
    """HyperConnection.mixes with the split order, Sinkhorn and pre-eps as parameters (the
    defaults reproduce the reference bit for bit)."""
    hc = mod.hc
    sizes = {"pre": hc, "post": hc, "comb": hc * hc}
    flat = unweighted_rms_norm(streams.flatten(start_dim=2).float(), mod.norm_eps)
    w = dict(zip(order, F.linear(flat, mod.fn.float()).split([sizes[o] for o in order], dim=-1)))
    b = dict(zip(order, mod.base.float().split([sizes[o] for o in order])))
    s = dict(zip(order, mod.scale.float().unbind(0)))
    pre = torch.sigmoid(w["pre"] * s["pre"] + b["pre"])
    if pre_eps:
        pre = pre + mod.hc_eps
    post = 2 * torch.sigmoid(w["post"] * s["post"] + b["post"])
    comb = sinkhorn_fn(w["comb"].unflatten(-1, (hc, hc)) * s["comb"] + b["comb"].view(hc, hc), mod.iters, mod.hc_eps)
    return mod.hook_pre(pre), mod.hook_post(post), mod.hook_comb(comb)


class MHCSplitOrder(HyperConnection):
    """fn/base/scale read as [pre, comb, post] instead of [pre, post, comb]."""

    def mixes(self, streams):
        return mhc_mixes(self, streams, order=("pre", "comb", "post"))


class MHCSinkhornFromExp(HyperConnection):
    def mixes(self, streams):
        return mhc_mixes(self, streams, sinkhorn_fn=sinkhorn_from_exp)


class MHCPreNoEps(HyperConnection):
    def mixes(self, streams):
        return mhc_mixes(self, streams, pre_eps=False)


class MHCCombNotTransposed(HyperConnection):
    @staticmethod
    def expand(streams, block_out, post, comb):
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.to(dtype), streams)  # BUG: no .transpose


# ------------------------------------------------------------------------------ attention
class AttentionSinkScaled(Attention):
    """Sink logit multiplied by the softmax scale (it is already in the scaled domain)."""

    def _attend(self, q, keys, bias):
        B, S, H, _ = q.shape
        logits = torch.matmul(q.transpose(1, 2), keys.unsqueeze(1).transpose(-1, -2)) * self.scale
        logits = logits + bias.unsqueeze(1).to(logits.dtype)
        sinks = (self.sink.to(logits.dtype) * self.scale).view(1, H, 1, 1).expand(B, H, S, 1)  # BUG
        combined = torch.cat([logits, sinks], dim=-1)
        combined = combined - combined.amax(dim=-1, keepdim=True)
        probs = self.hook_probs(torch.softmax(combined, dim=-1))
        out = torch.matmul(probs[..., :-1].to(keys.dtype), keys.unsqueeze(1))
        return out.transpose(1, 2)


class AttentionPaddedKVCounted(Attention):
    """Masked (padded) KV slots take part in the softmax as zero keys (logit 0, value 0) -- the
    kernel was told the padded length instead of the true one."""

    def _attend(self, q, keys, bias):
        B, S, H, _ = q.shape
        logits = torch.matmul(q.transpose(1, 2), keys.unsqueeze(1).transpose(-1, -2)) * self.scale
        masked = torch.isneginf(bias).unsqueeze(1)  # [B|1,1,S,L]
        logits = torch.where(masked, torch.zeros((), dtype=logits.dtype), logits)  # BUG: counted, as q.0
        sinks = self.sink.to(logits.dtype).view(1, H, 1, 1).expand(B, H, S, 1)
        combined = torch.cat([logits, sinks], dim=-1)
        combined = combined - combined.amax(dim=-1, keepdim=True)
        probs = self.hook_probs(torch.softmax(combined, dim=-1))
        p = probs[..., :-1].masked_fill(masked, 0.0)  # padded values are zero
        out = torch.matmul(p.to(keys.dtype), keys.unsqueeze(1))
        return out.transpose(1, 2)


# ------------------------------------------------------------------------------ indexer
class IndexerKeysPerHead(Indexer):
    """Keys treated MHA-style, one slice per head: head h dots only its Ih/Hi-wide slice of the
    query with the same slice of the (shared) key, instead of its full query with the full key."""

    def scores(self, x, q_res, positions, keys):
        B, S, _ = x.shape
        H, D = self.n_heads, self.head_dim
        q = self.wq_b(q_res).view(B, S, H, D)
        cos, sin = self.rotary(positions)
        q = self.hook_q(apply_rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2)))
        c = max(D // H, 1)
        qh = torch.diagonal(q.float()[..., : H * c].reshape(B, S, H, H, c), dim1=2, dim2=3).transpose(-1, -2)  # [B,S,H,c]
        kh = keys.float()[..., : H * c].reshape(B, keys.shape[1], H, c)  # BUG: per-head key slices
        s = torch.einsum("bshc,bthc->bsht", qh, kh)
        s = torch.relu(s) * self.head_dim ** -0.5
        w = self.weights_proj(x).float() * self.n_heads ** -0.5
        return (s * w.unsqueeze(-1)).sum(dim=2)


class IndexerQNoRope(Indexer):
    """Indexer queries used without RoPE (the compressed keys have it)."""

    def scores(self, x, q_res, positions, keys):
        B, S, _ = x.shape
        q = self.hook_q(self.wq_b(q_res).view(B, S, self.n_heads, self.head_dim))  # BUG: no apply_rope
        s = torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(1))
        s = torch.relu(s) * self.head_dim ** -0.5
        w = self.weights_proj(x).float() * self.n_heads ** -0.5
        return (s * w.unsqueeze(-1)).sum(dim=2)


class IndexerTopkWrongField(Indexer):
    """index_topk read from the wrong config field: twice the model's value (1024 for 512)."""

    def _setup_from_original(self, orig):
        self.topk = 2 * orig.topk  # BUG


class IndexerOff(Indexer):
    """The indexer silently disabled: every closed compressed entry is attended (no top-k)."""

    def _setup_from_original(self, orig):
        self.enabled = False  # BUG


# ------------------------------------------------------------------------------ router
class RouterBiasInWeights(Router):
    """The score-correction bias (meant only for choosing experts) also enters the weights."""

    def forward(self, x, input_ids):
        if self.is_hash:
            return super().forward(x, input_ids)
        flat = x.reshape(-1, x.shape[-1])
        logits = self.hook_logits(QLinear.forward(self, flat).float())
        biased = score_fn(self.scoring, logits) + self.bias.float()
        ids = self.hook_ids(torch.topk(biased, self.top_k, dim=-1, sorted=False).indices)
        w = biased.gather(1, ids)  # BUG: scores.gather
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, self.hook_weights(w * self.scale)


class HashRouterExpert0(Router):
    """A hash router that, given no token ids (the model run from embeddings and the ids
    dropped on the way), sends every token to expert 0 instead of refusing."""

    def forward(self, x, input_ids):
        if not self.is_hash or input_ids is not None:
            return super().forward(x, input_ids)
        flat = x.reshape(-1, x.shape[-1])
        logits = self.hook_logits(QLinear.forward(self, flat).float())
        scores = score_fn(self.scoring, logits)
        ids = self.hook_ids(torch.zeros(flat.shape[0], self.top_k, dtype=torch.long, device=x.device))  # BUG
        w = scores.gather(1, ids)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, self.hook_weights(w * self.scale)


class HashRouterIdsWrongDtype(Router):
    """tid2eid (int64) read as int32 (its bytes reinterpreted, as a loader that assumed the
    checkpoint's int32 does): each row becomes (e0, 0, e1, 0, ...)[:k], so a token's second
    choice is expert 0."""

    def forward(self, x, input_ids):
        if not self.is_hash:
            return super().forward(x, input_ids)
        if input_ids is None:
            raise ValueError("hash-routed layer needs input_ids")
        flat = x.reshape(-1, x.shape[-1])
        logits = self.hook_logits(QLinear.forward(self, flat).float())
        scores = score_fn(self.scoring, logits)
        table = self.tid2eid.contiguous().view(torch.int32)[:, : self.top_k]  # BUG: int64 bytes as int32
        ids = self.hook_ids(table[input_ids.reshape(-1)].long())
        w = scores.gather(1, ids)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, self.hook_weights(w * self.scale)


# ------------------------------------------------------------------------------ linears (mixins)
class WeightScale2DroppedMixin:
    """NVFP4 dequant without the per-tensor weight_scale_2: W = E2M1 * block_scale only."""

    def dense_weight(self, dtype):
        qw = self.qweight
        if qw is None or getattr(qw, "format", None) != "nvfp4":
            return super().dense_weight(dtype)

        out, inn = qw.shape
        codes = qw.codes().view(out, inn // NVFP4_BLOCK, NVFP4_BLOCK)
        one = torch.ones((), dtype=torch.float32, device=codes.device)
        return nvfp4_dequantize_blocks(codes, qw.block_scale, one).view(out, inn).to(dtype)  # BUG: no ws2


class ActInputScaleMixin:
    """W4A4 activations quantised with the checkpoint ``input_scale`` as the NVFP4 global scale
    (calibrated for another recipe; block scales saturate at 448 and values clip). Without a
    checkpoint input_scale the one of a calibration amax of ``calibrated_amax`` (1.0) is used."""

    calibrated_amax = 1.0

    def quantize_input(self, x):
        scale = getattr(self.qweight, "input_scale", None) if self.qweight is not None else None
        if scale is None:
            scale = torch.tensor(self.calibrated_amax / NVFP4_GS_DENOM)
        return fake_quant_nvfp4(x, scale.to(x.device, torch.float32))  # BUG: not amax(x)/(6*448)


class FP8ScaleLayoutMixin:
    """Official FP8-block weight whose [out/b, in/b] scale grid is read in the transposed
    (column-major) order: the same bytes viewed as [in/b, out/b] and transposed."""

    def dense_weight(self, dtype):
        qw = self.qweight
        if qw is None or getattr(qw, "format", None) != "fp8_block":
            return super().dense_weight(dtype)
        ob, ib = qw.scale.shape
        wrong = qw.scale.reshape(ib, ob).t()  # BUG: the grid is row-major [out/b, in/b]
        return FP8BlockWeight(qw.data, wrong.contiguous(), qw.block).dequantize(dtype)
