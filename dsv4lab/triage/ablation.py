"""Notebook 3: precision ablation -- per-component (and per-layer) precision, the one-at-a-time
sweep, the greedy precision floor, KL and per-layer cosine plots.

Setup: ``model`` holds NVFP4 weights (the embedded NVFP4 export, or the reference quantised in
memory); ``reference`` holds the original BF16 weights, which are also the ``orig`` source
(dsv4lab.precision.Originals). A policy is a dsv4lab.precision.PrecisionPolicy (or a spec it
parses); per component kind (and layer) it picks ``orig`` (the original BF16 weights swapped in),
``bf16`` (the FP4 weights dequantised once), ``w4a16`` / ``w4a4`` / ``w4a8`` / ``official``, and
switches DeepSeek's official round trips (``kv_fp8``, ``indexer_fp4`` ...; ``official`` = all five).

:func:`evaluate` is the one function both the widget panel and the headless cells call; it and
:func:`sweep` / :func:`floor` run dsv4lab.precision.sweep against the reference run.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace

import torch

from ..precision import (
    MODES,
    ROUND_TRIPS,
    Mode,
    Originals,
    PrecisionPolicy,
    linear_kind,
    linear_kinds,
    linear_layer,
)
from ..precision import sweep as engine
from ..precision.reference_cache import cached_reference_run
from ..quant.modes import as_mode
from .logits import topk_table
from .plots import bar, headless, lines, load_plotlyjs, show
from .session import quantized_twin, reference_of, reference_policy

DEFAULT = "default"  # the panel's word for "no rule: inherit"


@dataclass
class Setup:
    model: object          # NVFP4 weights (model under test)
    reference: object      # original BF16 weights
    ids: torch.Tensor
    kinds: list = field(default_factory=list)
    layers_of: dict = field(default_factory=dict)   # kind -> sorted layers (None = global)
    originals: Originals | None = None               # what ``orig`` swaps in: the reference's weights
    reference_policy: str = Mode.BF16                # how ``reference`` runs: bf16, or orig (reference checkpoint)
    cache: object = True                             # reference-run cache: True (DSV4LAB_CACHE), False, a dir
    _reference_run: engine.ReferenceRun | None = field(default=None, repr=False)

    def reference_run(self) -> engine.ReferenceRun:
        """The reference (original weights) run on ``ids``, computed once (streamed when the dense
        weights would not fit) and kept in the on-disk cache (dsv4lab.precision.reference_cache)."""
        if self._reference_run is None:
            self._reference_run = cached_reference_run(self.reference, self.ids, self.reference_policy, self.originals,
                                                       cache=self.cache)
        return self._reference_run


def make_setup(session, ids: torch.Tensor, cache=True) -> Setup:
    """Model under test, reference and ``orig`` source for ``session``. With a reference
    checkpoint (``open_session(..., reference=PATH)``) the reference is the model itself under
    ``orig``, its weights read from that checkpoint; no model is copied in any case but a plain
    session that is not the embedded model (quantised in memory, :func:`quantized_twin`).
    ``cache``: where the reference run is kept (True: ``$DSV4LAB_CACHE`` or the user cache dir;
    False: computed every time)."""
    q = quantized_twin(session)
    ref = reference_of(session, q)
    layers: dict = {}
    for name, _ in q.qlinears():
        layers.setdefault(linear_kind(name), set()).add(linear_layer(name))
    policy = reference_policy(session, q)
    originals = session.originals() if policy == Mode.ORIG else Originals.from_model(ref)
    return Setup(q, ref, ids.to(q.device), linear_kinds(q),
                 {k: sorted(v, key=lambda x: -1 if x is None else x) for k, v in layers.items()},
                 originals, Mode(policy), cache)


@torch.no_grad()
def evaluate(setup: Setup, policy) -> dict:
    """Run the model under ``policy`` (a PrecisionPolicy, mode string or mapping) and compare with
    the reference (original BF16) run: next-token KL (mean over positions and at the last one),
    top-1 agreement, per-layer cosine of the residual streams, router top-k overlap, the model's
    top-1 token at the last position."""
    policy = PrecisionPolicy.parse(policy)
    ref = setup.reference_run()
    res = engine.evaluate(setup.model, setup.ids, policy, ref, setup.originals).result
    last = res.last_logits_b[0]
    return {"policy": policy.describe(), "kl": res.kl_mean, "kl_last": res.kl_per_pos[-1], "kl_per_pos": res.kl_per_pos,
            "top1": res.top1, "topk": res.topk, "layer_cos": dict(sorted(res.layer_cos.items())),
            "min_layer_cos": res.min_layer_cos, "router_overlap": dict(sorted(res.router_overlap.items())),
            "top1_token_id": int(last.argmax()), "top1_ref_id": int(ref.logits[0, -1].argmax()), "result": res}


# ------------------------------------------------------------------------------ sweeps
def sweep(setup: Setup, flip: str, base: str = Mode.W4A16, per_layer: bool = False, kinds=None, progress: bool = False):
    """One kind (or one kind in one layer) at a time set to ``flip`` on top of ``base``, vs the
    original BF16 reference (dsv4lab.precision.sweep.precision_sweep). ``flip="orig"``: what
    restoring that component's original BF16 weights buys; ``flip="w4a4"`` on ``base="w4a16"``:
    what quantising its activations costs."""
    return engine.precision_sweep(setup.model, setup.ids, kinds=kinds, reference=setup.reference_run(), base=base,
                                  flip=flip, per_layer=per_layer, originals=setup.originals, progress=progress)


def round_trip_sweep(setup: Setup, base: str = Mode.W4A16, progress: bool = False):
    """Each of DeepSeek's official round trips alone on ``base``, then all five, vs the original
    BF16 reference (dsv4lab.precision.sweep.round_trip_sweep)."""
    return engine.round_trip_sweep(setup.model, setup.ids, base=base, reference=setup.reference_run(),
                                   originals=setup.originals, progress=progress)


def floor(setup: Setup, threshold: float, base: str = Mode.W4A4, fix: str = Mode.ORIG, kinds=None,
          max_steps: int | None = None) -> engine.FloorResult:
    """Greedy precision floor (dsv4lab.precision.sweep.precision_floor): from ``base`` everywhere,
    repeatedly set to ``fix`` the kind that lowers KL (vs the original BF16 reference) the most,
    until KL < threshold."""
    return engine.precision_floor(setup.model, setup.ids, threshold, base=base, fix=fix,
                                  reference=setup.reference_run(), kinds=kinds, originals=setup.originals,
                                  max_steps=max_steps, progress=False)


# ------------------------------------------------------------------------------ figures
def sweep_figure(df, title: str):
    d = df[df["kind"] != "(base)"]
    labels = d["kind"] if d["layers"].isna().all() else \
        [k if ls is None else f"{k} " + ",".join(f"L{l}" for l in ls) for k, ls in zip(d["kind"], d["layers"])]
    base_kl = float(df.loc[df["kind"] == "(base)", "kl"].iloc[0])
    fig = bar(labels, d["kl"], title, "component kind switched", "next-token KL vs original BF16 (nats)",
              text=[f"{v:.2e}" for v in d["kl"]])
    fig.add_hline(y=base_kl, line_dash="dash", annotation_text=f"base KL {base_kl:.2e}")
    fig.update_xaxes(tickangle=-40)
    return fig


def round_trip_figure(df):
    """KL and top-1 of each official round trip alone (and all five) against the base."""
    base = df.iloc[0]
    d = df.iloc[1:]
    fig = bar(list(d["round_trip"]), d["kl"], "Official round trips, one at a time: KL vs original BF16",
              "round trip switched on (alone, on the base policy)", "next-token KL (nats)",
              text=[f"{kl:.2e}, top-1 {t:.2f}" for kl, t in zip(d["kl"], d["top1"])])
    fig.add_hline(y=float(base["kl"]), line_dash="dash", annotation_text=f"base KL {base['kl']:.2e}, top-1 {base['top1']:.2f}")
    fig.update_xaxes(tickangle=-30)
    return fig


def layer_cos_figure(results: dict):
    """results: label -> evaluate() output; one line per policy."""
    any_r = next(iter(results.values()))
    layers = list(any_r["layer_cos"])
    fig = lines([f"L{int(l)}" for l in layers], {lab: [1 - r["layer_cos"][l] for l in layers] for lab, r in results.items()},
                "Per-layer damage: 1 - cosine(residual streams, original BF16)", "layer", "1 - cosine (log)", log_y=True,
                legend="policy")
    return fig


def kl_per_pos_figure(results: dict, tokens=None):
    any_r = next(iter(results.values()))
    x = tokens if tokens is not None else list(range(len(any_r["kl_per_pos"])))
    fig = lines(x, {lab: r["kl_per_pos"] for lab, r in results.items()},
                "Next-token KL vs original BF16 at each position", "input position", "KL (nats, log)", log_y=True, legend="policy")
    return fig


def floor_figure(steps):
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
        self.policy = PrecisionPolicy(default=default)
        self.auto = auto
        self.last: dict | None = None
        self._widgets = None

    # programmatic API (what the widget callbacks call)
    def set(self, kind: str, mode: str, layer=None) -> "AblationPanel":
        """``mode`` for every linear of ``kind`` (``"*"``: the default), or of ``kind`` in ``layer``;
        ``"default"`` drops that setting. A per-layer setting outranks the per-kind one."""
        layers = None if layer is None else [layer]
        if mode == DEFAULT and kind != "*":
            self.policy = self.policy.unset(kind, layers)
            return self
        mode = as_mode(mode)
        if kind == "*" and mode == Mode.OFFICIAL:  # the official policy: w4a16 + all five round trips
            self.policy = replace(PrecisionPolicy.official(), rules=list(self.policy.rules))
            return self
        self.policy = replace(self.policy, default=mode) if kind == "*" else self.policy.set(kind, mode, layers)
        return self

    def set_round_trip(self, name: str, on=True) -> "AblationPanel":
        """Switch one official round trip (``kv_fp8`` ...): True, False or a layer list."""
        self.policy = self.policy.with_round_trip(name, on)
        return self

    def run(self) -> dict:
        self.last = evaluate(self.setup, self.policy)
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
        import ipywidgets as W  # lazy: heavy optional dependency

        opts = [DEFAULT, *MODES]
        self._default = W.Dropdown(options=list(MODES), value=self.policy.default, description="all linears")
        self._kind_dd = {k: W.Dropdown(options=opts, value=getattr(self.policy.rule_for(k), "mode", DEFAULT), description=k,
                                       style={"description_width": "160px"}, layout=W.Layout(width="320px"))
                         for k in self.setup.kinds}
        self._lk = W.Dropdown(options=self.setup.kinds, description="kind")
        self._ll = W.Dropdown(options=[l for l in self.setup.layers_of[self.setup.kinds[0]]], description="layer")
        self._lm = W.Dropdown(options=opts, value=DEFAULT, description="mode")
        self._trips = {rt: W.Checkbox(value=rt in self.policy.round_trips, description=str(rt), indent=False,
                                      layout=W.Layout(width="170px")) for rt in ROUND_TRIPS}
        add = W.Button(description="set layer override")
        go = W.Button(description="run", button_style="primary")
        self._out = W.Output()

        def on_kind_for_layer(ch):
            self._ll.options = self.setup.layers_of[ch["new"]]

        def changed(_=None):
            self.set("*", self._default.value)
            for k, dd in self._kind_dd.items():
                self.set(k, dd.value)
            for rt, cb in self._trips.items():
                self.set_round_trip(rt, cb.value or (self._default.value == Mode.OFFICIAL))
            if self.auto:
                self.redraw()

        def add_override(_):
            self.set(self._lk.value, self._lm.value, self._ll.value)
            self.redraw()

        self._lk.observe(on_kind_for_layer, names="value")
        self._default.observe(changed, names="value")
        for dd in [*self._kind_dd.values(), *self._trips.values()]:
            dd.observe(changed, names="value")
        add.on_click(add_override)
        go.on_click(lambda _: self.redraw())
        grid = W.GridBox(list(self._kind_dd.values()), layout=W.Layout(grid_template_columns="repeat(3, 330px)"))
        self._widgets = W.VBox([W.HTML("<b>Precision per component kind</b> (orig = original BF16 weights)"), self._default,
                                grid, W.HTML("official round trips (all five = the 'official' default)"),
                                W.HBox(list(self._trips.values())), W.HBox([self._lk, self._ll, self._lm, add]), go, self._out])
        return self._widgets

    def redraw(self) -> None:
        """Rerun and show the readout, the per-layer cosine and the top-k table: inside the panel's
        Output area under a front end; as plain cell outputs headless (papermill's stand-in for an
        Output area talks back on the kernel's shell channel and can stall the cell until its timeout,
        jupyter/nbclient#312). plotly.js is loaded outside the Output area first, so the area holds
        only the figure."""
        from IPython.display import display  # lazy: heavy optional dependency

        r = self.run()
        load_plotlyjs()
        out = self._out if self._widgets is not None and not headless() else None
        ctx = out if out is not None else contextlib.nullcontext()
        if out is not None:
            out.clear_output(wait=True)
        with ctx:
            print(self.readout())
            show(layer_cos_figure({r["policy"]: r}))
            if self.session is not None:
                display(topk_table(self.session, r["result"].last_logits_b[0], 8))
