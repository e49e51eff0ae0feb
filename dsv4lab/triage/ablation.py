"""Notebook 3: precision ablation -- per-component (and per-layer) precision toggles, the
one-at-a-time sweep, the greedy precision floor, KL and per-layer cosine plots.

Setup: ``model`` holds NVFP4 weights (the embedded NVFP4 export, or the reference quantised in
memory); ``reference`` holds the original BF16 weights. Per component kind a toggle picks:

* ``orig``  -- the ORIGINAL BF16 weights (swapped in from the reference; what "keep lm_head in
  BF16" means when the engine is given both checkpoints),
* ``bf16``  -- the FP4 weights dequantised once, BF16 activations (``dsv4lab.precision`` bf16),
* ``w4a16`` / ``w4a4`` / ``w4a8`` -- see ``dsv4lab.precision``.

:func:`evaluate` is the one function both the widget panel and the headless cells call.
"""
from __future__ import annotations

import contextlib
import fnmatch
from dataclasses import dataclass, field

import torch

MODES = ("orig", "bf16", "w4a16", "w4a4", "w4a8")
SWEEP_HOOKS = ["layers.*.hook_resid_post", "layers.*.mlp.router.hook_ids"]


@dataclass
class Setup:
    model: object          # NVFP4 weights (model under test)
    reference: object      # original BF16 weights
    ids: torch.Tensor
    kinds: list = field(default_factory=list)
    layers_of: dict = field(default_factory=dict)   # kind -> sorted layers (None = global)


def make_setup(session, ids: torch.Tensor) -> Setup:
    from ..precision import linear_kind, linear_kinds, linear_layer
    from .session import quantized_twin, reference_of

    q = quantized_twin(session)
    ref = reference_of(session, q)
    layers: dict = {}
    for name, _ in q.qlinears():
        layers.setdefault(linear_kind(name), set()).add(linear_layer(name))
    return Setup(q, ref, ids.to(q.device), linear_kinds(q),
                 {k: sorted(v, key=lambda x: -1 if x is None else x) for k, v in layers.items()})


@dataclass
class Toggles:
    """default mode + per-kind modes + per-(kind, layer) modes (the later, the stronger)."""

    default: str = "w4a16"
    kinds: dict = field(default_factory=dict)      # kind -> mode
    layers: dict = field(default_factory=dict)     # (kind, layer) -> mode
    act_scale: str = "amax"

    def mode_for(self, kind: str, layer) -> str:
        return self.layers.get((kind, layer), self.kinds.get(kind, self.default))

    def describe(self) -> str:
        parts = [f"default={self.default}"] + [f"{k}={m}" for k, m in self.kinds.items()] + \
                [f"{k}[L{l}]={m}" for (k, l), m in self.layers.items()]
        return ", ".join(parts)


@contextlib.contextmanager
def applied_toggles(setup: Setup, toggles: Toggles):
    """Set every linear of ``setup.model`` as the toggles say (``orig`` swaps in the reference's
    weights); everything is put back on exit."""
    from ..precision import linear_kind, linear_layer, precision_state, restore_precision

    saved_modes = precision_state(setup.model)
    ref_lin = dict(setup.reference.qlinears())
    swapped = []
    try:
        for name, ql in setup.model.qlinears():
            mode = toggles.mode_for(linear_kind(name), linear_layer(name))
            if mode == "orig":
                if ql.quantized:
                    swapped.append((ql, ql.qweight))
                    ql.set_weight(ref_lin[name].dense_weight(setup.model.dtype).detach())
                ql.set_mode("dense")
            else:
                ql.set_mode(mode, toggles.act_scale)
        yield
    finally:
        for ql, qw in swapped:
            ql.set_weight(qw)
        restore_precision(setup.model, saved_modes)


_REF_CACHE: dict = {}


def _reference_run(setup: Setup):
    from ..analysis.cache import run_with_cache

    key = (id(setup.reference), tuple(setup.ids.flatten().tolist()))
    if key not in _REF_CACHE:
        from ..precision import apply_precision, precision_state, restore_precision

        saved = precision_state(setup.reference)
        apply_precision(setup.reference, "bf16")
        try:
            logits, cache = run_with_cache(setup.reference, setup.ids, names=SWEEP_HOOKS, device="cpu")
        finally:
            restore_precision(setup.reference, saved)
        _REF_CACHE.clear()
        _REF_CACHE[key] = (logits.detach().cpu(), cache)
    return _REF_CACHE[key]


@torch.no_grad()
def evaluate(setup: Setup, toggles: Toggles | str | dict) -> dict:
    """Run the model under ``toggles`` and compare with the reference (original BF16) run:
    next-token KL (mean over positions and at the last one), top-1 agreement, per-layer cosine of
    the residual streams, router top-k overlap, the model's top-1 token at the last position."""
    from ..analysis.compare import _compare_against

    if isinstance(toggles, str):
        toggles = Toggles(default=toggles)
    elif isinstance(toggles, dict):
        toggles = Toggles(**toggles)
    ref_logits, ref_cache = _reference_run(setup)
    with applied_toggles(setup, toggles):
        res = _compare_against(ref_logits, ref_cache, setup.model, None, setup.ids, SWEEP_HOOKS, 0.0, 5)
        last = setup.model(setup.ids)[0, -1].float().cpu()
    return {"policy": toggles.describe(), "kl": res.kl_mean, "kl_last": res.kl_per_pos[-1], "kl_per_pos": res.kl_per_pos,
            "top1": res.top1, "topk": res.topk, "layer_cos": dict(sorted(res.layer_cos.items())),
            "min_layer_cos": res.min_layer_cos, "router_overlap": dict(sorted(res.router_overlap.items())),
            "top1_token_id": int(last.argmax()), "top1_ref_id": int(ref_logits[0, -1].argmax()), "result": res}


# ------------------------------------------------------------------------------ sweeps
@torch.no_grad()
def sweep(setup: Setup, flip: str, base: str = "w4a16", per_layer: bool = False, kinds=None, progress: bool = False):
    """One kind (or one kind in one layer) at a time set to ``flip`` on top of ``base``, vs the
    original BF16 reference. ``flip="orig"``: what restoring that component's original BF16
    weights buys; ``flip="w4a4"`` on ``base="w4a16"``: what quantising its activations costs."""
    import pandas as pd

    rows = []
    b = evaluate(setup, Toggles(default=base))
    rows.append({"kind": "(base)", "layer": None, "mode": base, "kl": b["kl"], "kl_last": b["kl_last"], "top1": b["top1"],
                 "min_layer_cos": b["min_layer_cos"], "router_overlap": _mean(b["router_overlap"])})
    jobs = []
    for k in kinds or setup.kinds:
        if per_layer:
            jobs += [(k, l) for l in setup.layers_of[k]]
        else:
            jobs.append((k, None))
    it = jobs
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(jobs, desc=f"sweep {flip}", leave=False)
    for k, l in it:
        t = Toggles(default=base, kinds={} if per_layer else {k: flip}, layers={(k, l): flip} if per_layer else {})
        r = evaluate(setup, t)
        rows.append({"kind": k, "layer": l, "mode": flip, "kl": r["kl"], "kl_last": r["kl_last"], "top1": r["top1"],
                     "min_layer_cos": r["min_layer_cos"], "router_overlap": _mean(r["router_overlap"])})
    df = pd.DataFrame(rows)
    df["kl_change_vs_base"] = df["kl"] - b["kl"]
    return df


@torch.no_grad()
def floor(setup: Setup, threshold: float, base: str = "w4a4", fix: str = "orig", kinds=None, max_steps: int | None = None):
    """Greedy precision floor: from ``base`` everywhere, repeatedly set to ``fix`` the kind that
    lowers KL (vs the original BF16 reference) the most, until KL < threshold. Returns
    (chosen kinds in order, DataFrame of steps, reached)."""
    import pandas as pd

    cand = list(kinds or setup.kinds)
    chosen: list[str] = []
    r = evaluate(setup, Toggles(default=base))
    steps = [{"step": 0, "added": "(none)", "kl": r["kl"], "top1": r["top1"], "min_layer_cos": r["min_layer_cos"]}]
    kl = r["kl"]
    n = len(cand) if max_steps is None else max_steps
    for step in range(n):
        if kl < threshold or not cand:
            break
        best = None
        for k in cand:
            rr = evaluate(setup, Toggles(default=base, kinds={c: fix for c in chosen + [k]}))
            if best is None or rr["kl"] < best[1]["kl"]:
                best = (k, rr)
        k, rr = best
        chosen.append(k)
        cand.remove(k)
        kl = rr["kl"]
        steps.append({"step": step + 1, "added": k, "kl": kl, "top1": rr["top1"], "min_layer_cos": rr["min_layer_cos"]})
    return chosen, pd.DataFrame(steps), kl < threshold


def _mean(d: dict) -> float:
    return sum(d.values()) / len(d) if d else float("nan")


# ------------------------------------------------------------------------------ figures
def sweep_figure(df, title: str):
    from .plots import bar

    d = df[df["kind"] != "(base)"]
    labels = d["kind"] if d["layer"].isna().all() else [f"{k} L{l}" for k, l in zip(d["kind"], d["layer"])]
    base_kl = float(df.loc[df["kind"] == "(base)", "kl"].iloc[0])
    fig = bar(labels, d["kl"], title, "component kind switched", "next-token KL vs original BF16 (nats)",
              text=[f"{v:.2e}" for v in d["kl"]])
    fig.add_hline(y=base_kl, line_dash="dash", annotation_text=f"base KL {base_kl:.2e}")
    fig.update_xaxes(tickangle=-40)
    return fig


def layer_cos_figure(results: dict):
    """results: label -> evaluate() output; one line per policy."""
    from .plots import lines

    any_r = next(iter(results.values()))
    layers = list(any_r["layer_cos"])
    fig = lines([f"L{int(l)}" for l in layers], {lab: [1 - r["layer_cos"][l] for l in layers] for lab, r in results.items()},
                "Per-layer damage: 1 - cosine(residual streams, original BF16)", "layer", "1 - cosine (log)", log_y=True,
                legend="policy")
    return fig


def kl_per_pos_figure(results: dict, tokens=None):
    from .plots import lines

    any_r = next(iter(results.values()))
    x = tokens if tokens is not None else list(range(len(any_r["kl_per_pos"])))
    fig = lines(x, {lab: r["kl_per_pos"] for lab, r in results.items()},
                "Next-token KL vs original BF16 at each position", "input position", "KL (nats, log)", log_y=True, legend="policy")
    return fig


def floor_figure(steps):
    from .plots import bar

    return bar([f"{i}: +{a}" for i, a in zip(steps["step"], steps["added"])], steps["kl"],
               "Greedy precision floor: KL after each component is restored", "step: component restored",
               "next-token KL vs original BF16 (nats)", text=[f"{v:.2e}" for v in steps["kl"]])


# ------------------------------------------------------------------------------ widget panel
class AblationPanel:
    """ipywidgets panel: default mode, one dropdown per component kind, per-layer overrides,
    KL / cosine / top-k readout redrawn on every change. ``set(kind, mode, layer=None)`` and
    ``run()`` do programmatically what the widgets do (same :func:`evaluate` call)."""

    def __init__(self, setup: Setup, session=None, default: str = "w4a16", auto: bool = True) -> None:
        self.setup = setup
        self.session = session
        self.toggles = Toggles(default=default)
        self.auto = auto
        self.last: dict | None = None
        self._widgets = None

    # programmatic API (what the widget callbacks call)
    def set(self, kind: str, mode: str, layer=None) -> "AblationPanel":
        if mode not in MODES and mode != "default":
            raise ValueError(f"mode must be one of {MODES} or 'default'")
        if kind == "*":
            self.toggles.default = mode
        elif layer is None:
            if mode == "default":
                self.toggles.kinds.pop(kind, None)
            else:
                self.toggles.kinds[kind] = mode
        else:
            if mode == "default":
                self.toggles.layers.pop((kind, layer), None)
            else:
                self.toggles.layers[(kind, layer)] = mode
        return self

    def run(self) -> dict:
        self.last = evaluate(self.setup, self.toggles)
        return self.last

    def readout(self) -> str:
        r = self.last or self.run()
        tok = (lambda i: repr(self.session.tok(i))) if self.session is not None else str
        cos = " ".join(f"L{l}:{c:.5f}" for l, c in r["layer_cos"].items())
        return (f"policy: {r['policy']}\nKL mean {r['kl']:.3e}  KL last {r['kl_last']:.3e}  top-1 agreement {r['top1']:.3f}\n"
                f"top-1 at last position: {tok(r['top1_token_id'])} (reference {tok(r['top1_ref_id'])})\n"
                f"layer cosine: {cos}\nrouter overlap: " + " ".join(f"L{l}:{o:.3f}" for l, o in r["router_overlap"].items()))

    # widgets
    def widget(self):
        import ipywidgets as W

        opts = ["default", *MODES]
        self._default = W.Dropdown(options=list(MODES), value=self.toggles.default, description="all linears")
        self._kind_dd = {k: W.Dropdown(options=opts, value=self.toggles.kinds.get(k, "default"), description=k,
                                       style={"description_width": "160px"}, layout=W.Layout(width="320px"))
                         for k in self.setup.kinds}
        self._lk = W.Dropdown(options=self.setup.kinds, description="kind")
        self._ll = W.Dropdown(options=[l for l in self.setup.layers_of[self.setup.kinds[0]]], description="layer")
        self._lm = W.Dropdown(options=opts, value="default", description="mode")
        add = W.Button(description="set layer override")
        go = W.Button(description="run", button_style="primary")
        self._out = W.Output()

        def on_kind_for_layer(ch):
            self._ll.options = self.setup.layers_of[ch["new"]]

        def changed(_=None):
            self.toggles.default = self._default.value
            for k, dd in self._kind_dd.items():
                self.set(k, dd.value)
            if self.auto:
                self.redraw()

        def add_override(_):
            self.set(self._lk.value, self._lm.value, self._ll.value)
            self.redraw()

        self._lk.observe(on_kind_for_layer, names="value")
        self._default.observe(changed, names="value")
        for dd in self._kind_dd.values():
            dd.observe(changed, names="value")
        add.on_click(add_override)
        go.on_click(lambda _: self.redraw())
        grid = W.GridBox(list(self._kind_dd.values()), layout=W.Layout(grid_template_columns="repeat(3, 330px)"))
        self._widgets = W.VBox([W.HTML("<b>Precision per component kind</b> (orig = original BF16 weights)"), self._default,
                                grid, W.HBox([self._lk, self._ll, self._lm, add]), go, self._out])
        return self._widgets

    def redraw(self) -> None:
        from IPython.display import display

        from .plots import show

        r = self.run()
        out = self._out if self._widgets is not None else None
        ctx = out if out is not None else contextlib.nullcontext()
        if out is not None:
            out.clear_output(wait=True)
        with ctx:
            print(self.readout())
            show(layer_cos_figure({r["policy"]: r}))
            if self.session is not None:
                from .logits import topk_table

                display(topk_table(self.session, r["result"] and self._last_logits(), 8))

    def _last_logits(self):
        with applied_toggles(self.setup, self.toggles), torch.no_grad():
            return self.setup.model(self.setup.ids)[0, -1].float().cpu()
