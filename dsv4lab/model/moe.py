"""Mixture of experts: hash or top-k router, routed SwiGLU experts, one shared expert.

Router scores = sqrt(softplus(logits)) (or softmax/sigmoid); top-k layers choose by
scores + bias (bias only for choosing), hash layers by tid2eid[token]; weights are the chosen
scores renormalised and times routed_scaling_factor. Expert: w2(silu(clamp(w1 x, max=L)) *
clamp(w3 x, -L, L)) -- the clamp comes BEFORE SiLU.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..config import HASH_MOE, DSV4Config
from ..quant.modes import Mode, RoundTrip
from ..quant.stacked import StackedMXFP4, StackedNVFP4, stack_one
from .component import Component, changes
from .expert_stack import ExpertStack
from .hooks import HookPoint
from .linear import QLinear, offer_pair
from .swiglu import clamped_swiglu

# A prefill of at most this many tokens takes the routed experts' decode kernel (2 launches:
# each token's k experts gathered) instead of the grouped prefill kernel, whose on-device
# schedule (sort by expert, tile table) costs ~30 launches: short prompts are what every
# triage evaluation prefills (benchmarks/launch_inventory.py --prefill 11).
SHORT_PREFILL_TOKENS = 16


def score_fn(name: str, logits: torch.Tensor) -> torch.Tensor:
    if name == "sqrtsoftplus":
        return torch.sqrt(F.softplus(logits))
    if name == "softmax":
        return torch.softmax(logits, dim=-1)
    return torch.sigmoid(logits)


class Router(QLinear):
    """Top-k (learned, bias-corrected) or hash (tid2eid lookup) expert choice.

    It IS the gate linear (a QLinear, so its precision can be flipped like any linear)."""

    def __init__(self, config: DSV4Config, is_hash: bool) -> None:
        super().__init__(config.hidden_size, config.n_routed_experts)
        self.is_hash = is_hash
        self.top_k = config.num_experts_per_tok
        self.scoring = config.scoring_func
        self.scale = config.routed_scaling_factor
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.register_buffer("bias", torch.zeros(config.n_routed_experts))
        # optional fused scores + choice + weights after the gate matmul, with ``route``'s signature
        # (dsv4lab.kernels); not used while a router hook listens
        self.route_kernel: Callable | None = None
        self.hook_logits = HookPoint("router logits [T,E] (fp32)")
        self.hook_ids = HookPoint("chosen experts [T,k] (long)")
        self.hook_weights = HookPoint("routing weights [T,k] (fp32, scaled)")

    def kernel_applies(self) -> bool:
        """Does a call run ``route_kernel``? Installed, no router hook listening (the kernel never
        shows the logits, ids and weights to hooks) and not training (it has no backward)."""
        return (self.route_kernel is not None
                and not (self.hook_logits.active or self.hook_ids.active or self.hook_weights.active)
                and not (self.training and torch.is_grad_enabled()))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1, x.shape[-1])
        if self.is_hash and input_ids is None:
            raise ValueError("hash-routed layer needs input_ids")
        if self.kernel_applies():
            fused = self._gate_route(flat, input_ids)
            if fused is not None:
                return fused
            logits = QLinear.forward(self, flat)
            return self.route_kernel(logits, self.top_k, self.scoring, self.scale, *self._choice(input_ids))
        logits = QLinear.forward(self, flat)
        logits = self.hook_logits(logits.float())
        scores = score_fn(self.scoring, logits)
        ids = self.hook_ids(choose_experts(scores, self.top_k, *self._choice(input_ids)))
        return ids, self.hook_weights(routing_weights(scores, ids, self.scoring, self.scale))

    def _gate_route(self, flat: torch.Tensor, input_ids: torch.Tensor | None) -> tuple | None:
        """The gate and the route as one call, where the route slot declares this linear's plain slot
        (``route_kernel.with_gate`` / ``gate_fuses_with``) and the gate would run that slot on its
        unquantised weight (``batchable``; no output offered); None otherwise or where the kernel
        declines (the caller then runs the two). Why: two dependent launches a decode layer."""
        with_gate = getattr(self.route_kernel, "with_gate", None)
        if (with_gate is None or self._offered is not None
                or getattr(self.route_kernel, "gate_fuses_with", None) is not self.plain_kernel):
            return None
        w = self.batchable(flat)
        if w is None:
            return None
        return with_gate(flat, w, self.top_k, self.scoring, self.scale, *self._choice(input_ids))

    def _choice(self, input_ids: torch.Tensor | None) -> tuple:
        """(bias, tid2eid, input_ids): what chooses the experts (bias for top-k layers, the
        table and the tokens for hash layers)."""
        return (None, self.tid2eid, input_ids) if self.is_hash else (self.bias, None, None)


def choose_experts(scores: torch.Tensor, top_k: int, bias: torch.Tensor | None = None,
                   tid2eid: torch.Tensor | None = None, input_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Expert ids [T, k] (long): tid2eid[token] (hash layers) or the top-k of scores + bias."""
    if tid2eid is not None:
        return tid2eid[input_ids.reshape(-1)].long()
    return torch.topk(scores + bias.float(), top_k, dim=-1, sorted=False).indices


def routing_weights(scores: torch.Tensor, ids: torch.Tensor, scoring: str, scale: float) -> torch.Tensor:
    """The chosen scores [T, k], renormalised unless softmax, times the routed scaling factor."""
    w = scores.gather(1, ids)
    if scoring != "softmax":
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scale


def route(logits: torch.Tensor, top_k: int, scoring: str, scale: float, bias: torch.Tensor | None = None,
          tid2eid: torch.Tensor | None = None, input_ids: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The router after its gate matmul (the reference of ``Router.route_kernel``): logits [T, E]
    -> ids [T, k] (long), weights [T, k] (fp32)."""
    scores = score_fn(scoring, logits.float())
    ids = choose_experts(scores, top_k, bias, tid2eid, input_ids)
    return ids, routing_weights(scores, ids, scoring, scale)


class Expert(Component):
    """One SwiGLU FFN with the DSV4 clamp (also the shared expert)."""

    def __init__(self, config: DSV4Config) -> None:
        super().__init__()
        self.limit = config.swiglu_limit
        self.w1 = QLinear(config.hidden_size, config.moe_intermediate_size)
        self.w3 = QLinear(config.hidden_size, config.moe_intermediate_size)
        self.w2 = QLinear(config.moe_intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """w2(swiglu); ``weight`` [T, 1] (the routing weight) multiplies the SwiGLU output
        before w2 (the official order) when given."""
        h = clamped_swiglu(self.w1(x), self.w3(x), self.limit)
        if weight is not None:
            h = h * weight.to(h.dtype)
        return self.w2(h)


class SharedExpert(Expert):
    """The shared expert. Where it runs on its own (not folded into the routed experts' kernel:
    ``MoE.shared_folds``; e.g. the official format's FP8-block shared expert) two optional slots
    cut its launches: ``quant_pair_kernel`` f(x, w1, w3) -> (x @ w1^T, x @ w3^T) or None, one
    launch whose outputs are ``offer``-ed to w1 and w3 (each the bits of its own linear, so their
    hooks see the same tensors), and ``swiglu_kernel`` f(gate, up, limit) -> the bits of
    ``clamped_swiglu`` in one launch (the reference is four)."""

    def __init__(self, config: DSV4Config) -> None:
        super().__init__(config)
        self.hook_out = HookPoint("shared expert output [B,S,D]")
        self.quant_pair_kernel: Callable | None = None
        self.swiglu_kernel: Callable | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offer_pair(self.quant_pair_kernel, x, self.w1, self.w3)
        swiglu = self.swiglu_kernel if self.swiglu_kernel is not None else clamped_swiglu
        return self.hook_out(self.w2(swiglu(self.w1(x), self.w3(x), self.limit)))


class Experts(Component):
    """Routed experts. ``sparse`` (prefill) visits only hit experts (host sync); ``masked``
    (decode, graph-safe) runs every expert and zero-weights the unchosen; ``gathered`` (decode,
    graph-safe, ``gather_in_decode``) reads only the chosen experts from the stacked weights.

    ``kernel``: optional fused decode implementation ``f(x, ids, weights, w1, w3, w2, limit)``
    over ``dsv4lab.quant.stacked.StackedNVFP4`` / ``StackedMXFP4`` stacks or plain weight stacks
    [E, out, in] (``dsv4lab.kernels.dispatch.moe_decode``, installed by ``use_kernels``). Graph-safe
    decode calls it instead of the reference when every projection is NVFP4 (or every one MXFP4,
    or every one plain), the mode is ``w4a16`` (no activation quant), x is on one of ``kernel_devices`` and
    ``hook_expert_out`` is not active (it needs per-expert outputs: the reference runs then).

    ``prefill_kernel``: optional grouped prefill ``f(x, ids, weights, w1, w3, w2, limit,
    weight_before_w2)`` over the same stacks (``dsv4lab.kernels.dispatch.moe_prefill``): the
    sparse (non-graph-safe) path calls it under the same conditions as ``kernel``, except that it
    applies the routing weight in either order.

    ``weight_before_w2`` (the round trip of that name, or ``w4a8`` / ``official`` experts): each
    expert gets its routing weight before w2; ``hook_expert_out`` then shows weighted outputs."""

    kernel_devices = ("cuda",)
    ROUND_TRIPS = (RoundTrip.WEIGHT_BEFORE_W2,)

    def __init__(self, config: DSV4Config) -> None:
        super().__init__()
        self.n_experts = config.n_routed_experts
        for e in range(self.n_experts):  # children named "0", "1", ... -> mlp.experts.E.w1
            self.add_module(str(e), Expert(config))
        self.limit = config.swiglu_limit
        self._stack = None
        self._stack_seen = (-1, None)  # (changes() when stack() last decided, its answer)
        self._applies_seen: dict = {}  # (changes(), prefill, id(stack)) -> kernel_applies' host checks
        self._kernel_stacks = None  # (ExpertStack, (w1, w3, w2) StackedNVFP4/StackedMXFP4 views of it)
        self.kernel = None  # optional fused decode fast path (see the class docstring)
        self.prefill_kernel = None  # optional grouped prefill fast path (see the class docstring)
        self.round_trips: frozenset = frozenset()  # of RoundTrip; set by dsv4lab.precision
        self.gather_in_decode = config.n_routed_experts > 16  # small E: the masked loop is as cheap
        self.hook_expert_out = HookPoint("per-token chosen experts' outputs [T,k,D], unweighted")
        self.hook_out = HookPoint("routed sum [T,D]")

    def __getitem__(self, i: int) -> Expert:
        return self._modules[str(i)]

    def __len__(self) -> int:
        return self.n_experts

    @property
    def weight_before_w2(self) -> bool:
        """Does the routing weight multiply SwiGLU(gate, up) before w2? The round trip, or
        experts whose w2 runs ``w4a8`` / ``official`` (DeepSeek's expert order)."""
        return (RoundTrip.WEIGHT_BEFORE_W2 in self.round_trips
                or self[0].w2.mode in (Mode.W4A8, Mode.OFFICIAL))

    def stack(self):
        """The stacked view of the expert weights (built once, rebuilt if a weight was swapped);
        None when the experts cannot share one stack (mixed formats or modes, or a replaced
        expert implementation). The answer is kept until a component counts a change
        (``component.changes()``: swaps, modes, kernels): deciding walks every expert, which is
        O(E) Python per call (384 experts: milliseconds a layer, every eager step)."""
        seen, answer = self._stack_seen
        if seen == changes():
            return answer
        answer = self._decide_stack()
        self._stack_seen = (changes(), answer)  # after building: building assigns the experts' views
        return answer

    def _decide_stack(self):
        modes = {(getattr(self[e], p).mode, getattr(self[e], p).act_scale, getattr(self[e], p).round_trips)
                 for e in range(self.n_experts) for p in ExpertStack.PROJ}
        if len(modes) != 1 or any(type(self[e]) is not Expert for e in range(self.n_experts)):
            return None
        if self._stack is None or self._stack.key != ExpertStack.identity(self):
            try:
                self._stack = ExpertStack(self)
            except ValueError:
                return None
        return self._stack

    def kernel_applies(self, x: torch.Tensor, stack, prefill: bool = False) -> bool:
        """Would graph-safe decode run ``self.kernel`` (``prefill``: the sparse path
        ``self.prefill_kernel``) on ``x`` with this stack? (Host-side checks only: no device syncs;
        the O(E) part is kept until a component counts a change, as ``stack()``.)"""
        if stack is None or (self.prefill_kernel if prefill else self.kernel) is None:
            return False
        key = (changes(), prefill, id(stack))
        ok = self._applies_seen.get(key)
        if ok is None:
            ok = self._kernel_applies_to(stack, prefill)
            self._applies_seen = {key: ok, **{k: v for k, v in self._applies_seen.items() if k[0] == key[0]}}
        return ok and x.device.type in self.kernel_devices

    def _kernel_applies_to(self, stack, prefill: bool) -> bool:
        # plain (unquantised) stacks: the decode kernel only (no plain grouped prefill kernel)
        fmts = ("nvfp4", "mxfp4") if prefill else ("nvfp4", "mxfp4", "plain")
        return (len({stack.formats[p] for p in stack.PROJ}) == 1 and stack.formats["w1"] in fmts
                # stack() guarantees one mode for every projection; the kernel quantises nothing
                and self[0].w1.act_format() == "none" and (prefill or not self.weight_before_w2)
                # a replaced linear (e.g. another quantize_input) is not what the kernel computes
                and all(type(getattr(self[e], p)) is QLinear for e in range(self.n_experts) for p in stack.PROJ))

    def kernel_stacks(self, stack):
        """(w1, w3, w2) as ``StackedNVFP4`` / ``StackedMXFP4`` wrapping the ExpertStack tensors
        (views, no copy), or the plain stacks' weight tensors themselves; cached per stack."""
        if self._kernel_stacks is None or self._kernel_stacks[0] is not stack:
            if stack.formats["w1"] == "plain":
                ws = tuple(stack.tensors[p]["weight"] for p in ("w1", "w3", "w2"))
            elif stack.formats["w1"] == "mxfp4":
                ws = tuple(StackedMXFP4(stack.tensors[p]["packed"], stack.tensors[p]["scale"]) for p in ("w1", "w3", "w2"))
            else:
                ws = tuple(StackedNVFP4(stack.tensors[p]["packed"], stack.tensors[p]["scale"],
                                        stack.tensors[p]["gs"].reshape(-1).float()) for p in ("w1", "w3", "w2"))
            self._kernel_stacks = (stack, ws)
        return self._kernel_stacks[1]

    def _gathered(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, stack,
                  want_each: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Graph-safe decode: gather each token's k experts on the device, batched matmuls
        (or the fused kernel when one is installed and applies; it gives no per-expert outputs,
        so ``want_each`` takes the reference)."""
        if not want_each and self.kernel_applies(x, stack):
            w1, w3, w2 = self.kernel_stacks(stack)
            return self.kernel(x, ids, weights, w1, w3, w2, self.limit).to(x.dtype), None
        T, D = x.shape
        k = ids.shape[1]
        flat = ids.reshape(-1)
        xr = self[0].w1.quantize_input(x).repeat_interleave(k, dim=0).unsqueeze(-1)  # [T*k, D, 1]
        dt = x.dtype
        gate = torch.bmm(stack.gather("w1", flat, dt), xr).squeeze(-1)
        up = torch.bmm(stack.gather("w3", flat, dt), xr).squeeze(-1)
        h = clamped_swiglu(gate, up, self.limit)
        before = self.weight_before_w2
        if before:
            h = h * weights.reshape(-1, 1).to(h.dtype)
        h = self[0].w2.quantize_input(h).unsqueeze(-1)
        y = torch.bmm(stack.gather("w2", flat, dt), h).squeeze(-1).view(T, k, D)
        return (y.sum(1) if before else (y * weights.unsqueeze(-1).to(y.dtype)).sum(1)), y

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, graph_safe: bool = False) -> torch.Tensor:
        T, D = x.shape
        k = ids.shape[1]
        want_each = self.hook_expert_out.active
        each = x.new_zeros(T, k, D) if want_each else None
        # an installed kernel takes the gathered route even for small E (it reads only the
        # chosen experts); without one, small E keeps the masked loop
        use_kernel = graph_safe and self.kernel is not None and not want_each
        stack = self.stack() if graph_safe and (self.gather_in_decode or use_kernel) else None
        if stack is not None and (self.gather_in_decode or (use_kernel and self.kernel_applies(x, stack))):
            out, each_g = self._gathered(x, ids, weights, stack, want_each)
            if want_each:
                self.hook_expert_out(each_g)
            return self.hook_out(out)
        if not graph_safe and T <= SHORT_PREFILL_TOKENS and self.kernel is not None and not want_each:
            stack = self.stack()
            if self.kernel_applies(x, stack):
                w1, w3, w2 = self.kernel_stacks(stack)
                return self.hook_out(self.kernel(x, ids, weights, w1, w3, w2, self.limit).to(x.dtype))
        before = self.weight_before_w2
        if not graph_safe and self.prefill_kernel is not None and not want_each:
            stack = self.stack()
            if self.kernel_applies(x, stack, prefill=True):
                w1, w3, w2 = self.kernel_stacks(stack)
                return self.hook_out(self.prefill_kernel(x, ids, weights, w1, w3, w2, self.limit, before).to(x.dtype))
        out = torch.zeros_like(x)  # only the loops accumulate (a zero-fill launch the kernel paths skip)
        if graph_safe:
            for e in range(self.n_experts):
                expert = self[e]
                hit = ids == e  # [T,k]
                w_e = (weights * hit).sum(-1, keepdim=True)
                y = expert(x, w_e) if before else expert(x)
                out = out + (y if before else y * w_e.to(y.dtype))
                if want_each:
                    each = each + hit.unsqueeze(-1).to(y.dtype) * y.unsqueeze(1)
        else:
            for e in torch.unique(ids).tolist():
                pos_t, pos_k = torch.where(ids == e)
                w_e = weights[pos_t, pos_k, None]
                y = self[e](x[pos_t], w_e) if before else self[e](x[pos_t])
                out.index_add_(0, pos_t, (y if before else y * w_e.to(y.dtype)).to(out.dtype))
                if want_each:
                    each[pos_t, pos_k] = y.to(each.dtype)
        if want_each:
            self.hook_expert_out(each)
        return self.hook_out(out)


class MoE(Component):
    """Router, routed experts and the shared expert: routed + shared, both in x.dtype.

    Graph-safe decode folds the shared expert into the routed experts' kernel (``shared=``: one
    more GEMV pair per token in the same launches) when that kernel says it can
    (``folds_shared``), both run the same weight format and mode, and no hook listens to the
    routed sum, the per-expert outputs or the shared expert's output."""

    def __init__(self, config: DSV4Config, layer: int) -> None:
        super().__init__()
        self.router = Router(config, config.mlp_layer_types[layer] == HASH_MOE)
        self.experts = Experts(config)
        self.shared_expert = SharedExpert(config) if config.n_shared_experts else None
        self.hook_out = HookPoint("MoE block output [B,S,D]")
        self._fold_seen = (-1, None)  # (changes() when decided, the shared expert's one-expert stacks or None)

    def shared_folds(self, x: torch.Tensor) -> tuple | None:
        """The shared expert's (w1, w3, w2) as one-expert stacks when graph-safe decode of ``x``
        [T, D] folds it into ``experts.kernel``, else None. Hooks and the device are checked every
        call; the O(E) rest is kept until a component counts a change (as ``Experts.stack``)."""
        se, ex = self.shared_expert, self.experts
        if (se is None or se.hook_out.active or ex.hook_out.active or ex.hook_expert_out.active
                or not getattr(ex.kernel, "folds_shared", False)):
            return None
        seen, stacks = self._fold_seen
        if seen != changes():
            stacks = self._decide_fold()
            self._fold_seen = (changes(), stacks)
        return stacks if stacks is not None and ex.kernel_applies(x, ex.stack()) else None

    def _decide_fold(self) -> tuple | None:
        se, ex = self.shared_expert, self.experts
        stack = ex.stack()
        routed, lins = ex[0], [getattr(se, p) for p in ExpertStack.PROJ]
        if (type(se) is not SharedExpert or stack is None or se.limit != ex.limit
                or any(m._forward_hooks or m._forward_pre_hooks for m in (ex, se, *lins))):
            return None  # a torch hook on a module the fold never calls would silently not fire
        if any(type(ql) is not QLinear or ql.format != stack.formats[p] or ql.qweight is None
               or (ql.mode, ql.act_scale, ql.round_trips) != (getattr(routed, p).mode, getattr(routed, p).act_scale,
                                                              getattr(routed, p).round_trips)
               or ql.qweight.packed.shape != stack.tensors[p]["packed"].shape[1:]
               for p, ql in zip(ExpertStack.PROJ, lins)):
            return None
        return tuple(stack_one(ql.qweight) for ql in lins)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None, graph_safe: bool = False) -> torch.Tensor:
        B, S, D = x.shape
        ids, w = self.router(x, input_ids)
        flat = x.reshape(-1, D)
        shared = self.shared_folds(flat) if graph_safe else None
        if shared is not None:
            w1, w3, w2 = self.experts.kernel_stacks(self.experts.stack())
            out = self.experts.kernel(flat, ids, w, w1, w3, w2, self.experts.limit, shared=shared)
            return self.hook_out(out.to(x.dtype).view(B, S, D))
        routed = self.experts(flat, ids, w, graph_safe).view(B, S, D)
        if self.shared_expert is not None:
            routed = routed + self.shared_expert(x)
        return self.hook_out(routed)
