"""Decode benchmark for the device machine (CUDA). Prints JSON; ratios, not asserts.

(a) the embedded tiny model: per-step latency, eager vs CUDA graph, token/logit agreement;
(b) one V4-Pro-sized decoder layer (hidden 7168, 128 heads x 512, 384 experts top-6,
    moe_intermediate 3072, NVFP4 experts/shared/attention, BF16 router + compressor/indexer
    helper projections as our users' engine runs them), batch 1, eager vs graph, with achieved
    weight bandwidth against a device-to-device copy ceiling measured in the same run.
    ``--format official`` builds the layer as the official checkpoint stores it instead: MXFP4
    routed experts, FP8-block (block 128) for the other quantised linears.

    python3 benchmarks/decode.py --json [--steps 512] [--layer-modes reference,kernels] [--format official]
        [--helpers quantised]   (the compressor / indexer helper projections as the NVFP4 export stores them)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.layer_graph_decode import layer_graph_timing  # noqa: E402
from benchmarks.measure import copy_ceiling, host_op_us, kernels_per_call, timed  # noqa: E402
from dsv4lab import lanes  # noqa: E402
from dsv4lab.config import config_from_dict  # noqa: E402
from dsv4lab.model.decoder import DecoderLayer  # noqa: E402
from dsv4lab.model.linear import QLinear  # noqa: E402
from dsv4lab.model.rope import Rotary, inverse_frequencies  # noqa: E402
from dsv4lab.model.state import DecodeState  # noqa: E402
from dsv4lab.quant.weights import FP8BlockWeight, MXFP4Weight, NVFP4Weight  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"  # default --json location


V4_PRO = dict(model_type="deepseek_v4", vocab_size=1024, hidden_size=7168, num_hidden_layers=1, num_attention_heads=128,
              head_dim=512, qk_rope_head_dim=64, q_lora_rank=1536, o_groups=16, o_lora_rank=1024,
              n_routed_experts=384, num_experts_per_tok=6, moe_intermediate_size=3072, index_n_heads=64,
              index_head_dim=128, index_topk=512, sliding_window=128, hc_mult=4,
              compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
              mlp_layer_types=["moe"])
LAYER_MODES = ("reference", "kernels", "compiled")
BF16_KINDS = ("router", "compressor.", "indexer.weights_proj", "indexer.compressor.")
HELPERS = ("bf16", "quantised")  # the compressor / indexer helper projections: as our users' engine, as the NVFP4 export


def random_nvfp4(out, inn, dev, g) -> NVFP4Weight:
    packed = torch.randint(0, 256, (out, inn // 2), dtype=torch.uint8, device=dev, generator=g)
    scale = (torch.rand(out, inn // 16, device=dev, generator=g) + 0.5).to(torch.float8_e4m3fn)
    return NVFP4Weight(packed, scale, torch.tensor(0.02 / 6, device=dev))


def random_official(out, inn, dev, g, expert: bool):
    """The official checkpoint's formats: MXFP4 experts (E8M0 2^-9..2^-5), FP8-block elsewhere."""
    if expert:
        packed = torch.randint(0, 256, (out, inn // 2), dtype=torch.uint8, device=dev, generator=g)
        return MXFP4Weight(packed, torch.randint(118, 123, (out, inn // 32), dtype=torch.uint8, device=dev, generator=g))
    data = torch.randn(out, inn, device=dev, generator=g).to(torch.float8_e4m3fn)
    return FP8BlockWeight(data, torch.full((-(-out // 128), -(-inn // 128)), 0.02 / 3, device=dev))


def build_layer(layer_type: str, dev, small: bool = False, fmt: str = "nvfp4",
                helpers: str = "bf16") -> tuple[DecoderLayer, object, int]:
    """The layer with random weights on ``dev``; ``helpers``: the compressor / indexer helper
    projections BF16 (our users' engine) or quantised like the rest (the NVFP4 export, where only
    the router stays BF16: ``dsv4lab.checkpoint.synth.NVFP4_EXCLUDE``)."""
    if helpers not in HELPERS:
        raise ValueError(f"helpers must be one of {HELPERS}, got {helpers!r}")
    plain_kinds = BF16_KINDS if helpers == "bf16" else ("router",)
    spec = dict(V4_PRO, layer_types=[layer_type])
    if small:  # CPU smoke test of this script
        spec.update(hidden_size=256, num_attention_heads=8, head_dim=64, qk_rope_head_dim=32, q_lora_rank=64,
                    o_groups=4, o_lora_rank=32, n_routed_experts=32, moe_intermediate_size=64, index_n_heads=4,
                    index_head_dim=32)
    cfg = config_from_dict(spec)
    with torch.device("meta"):
        layer = DecoderLayer(cfg, 0)
    # quantised weights are set while the layer is still on meta, so ``to_empty`` never allocates the
    # BF16 masters of 384 experts (50 GB: the layer did not fit on an 80 GB H100); the plain ones after
    # it (``to_empty`` would blank them), drawn in the same order, so the weights are what they were
    g = torch.Generator(device=dev).manual_seed(0)
    active_bytes = 0
    plain: list[tuple[QLinear, torch.Tensor]] = []
    for name, mod in layer.named_modules():
        if isinstance(mod, QLinear):
            is_expert = ".experts." in f".{name}."
            if any(k in name for k in plain_kinds) or name == "mlp.router":
                w = torch.randn(mod.out_features, mod.in_features, device=dev, generator=g, dtype=torch.bfloat16) * mod.in_features ** -0.5
                plain.append((mod, w))
                nb = w.numel() * 2
            else:
                if fmt == "official":
                    mod.set_weight(random_official(mod.out_features, mod.in_features, dev, g, is_expert))
                else:
                    mod.set_weight(random_nvfp4(mod.out_features, mod.in_features, dev, g))
                nb = mod.qweight.nbytes
            if not is_expert:
                active_bytes += nb
            elif name.startswith("mlp.experts.0."):
                active_bytes += nb * cfg.num_experts_per_tok  # top-6 experts of this size
    layer = layer.to_empty(device=dev)
    for mod, w in plain:
        mod.set_weight(w)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name or name.endswith(".scale"):
                p.fill_(1.0)
            elif p.dtype.is_floating_point:
                p.copy_(torch.randn(p.shape, device=dev, generator=g) * 0.02)
        for name, b in layer.named_buffers():
            if name.endswith("router.bias"):
                b.zero_()
        for name, p in layer.named_parameters():  # compute dtype bf16; mHC/sink/ape stay fp32
            if not any(k in name for k in ("_hc.", "sink", "ape")):
                p.data = p.data.to(torch.bfloat16)
        for mod in layer.modules():
            if isinstance(mod, Rotary):
                mod._buffers["inv_freq"] = inverse_frequencies(cfg, mod.kind).to(dev)
    return layer.eval(), cfg, active_bytes


@torch.no_grad()
def bench_layer(layer_type: str, dev, ceiling: float, mode: str, fmt: str = "nvfp4", helpers: str = "bf16") -> dict:
    """One layer's decode step, eager and replayed from a CUDA graph, with its launches per step.
    ``mode``: "reference" (PyTorch only), "kernels" (installed kernels), "compiled" (kernels, and
    the step through ``torch.compile``: Inductor fuses the glue)."""
    layer, cfg, active = build_layer(layer_type, dev, fmt=fmt, helpers=helpers)
    if mode in ("kernels", "compiled"):
        from dsv4lab.kernels.install import install_kernels
        install_kernels(layer)
    st = DecodeState.allocate(cfg, 1, 4096, torch.bfloat16, dev)
    h = torch.randn(1, 1, cfg.hc_mult, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    ids = torch.zeros(1, 1, dtype=torch.long, device=dev)
    pos = st.pos_on(dev)
    pos.fill_(1000)
    step = layer.decode
    t0 = time.perf_counter()
    if mode == "compiled":
        step = torch.compile(layer.decode, dynamic=False)
    step(h, ids, pos, st.layers[0])  # warm caches (expert stack), compile
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    eager = timed(lambda: step(h, ids, pos, st.layers[0]), 50, warmup=5)
    eager_launches = kernels_per_call(lambda: step(h, ids, pos, st.layers[0]), reps=2)
    s = torch.cuda.Stream(device=dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with lanes.capturing():  # as the graph decoders: warm-up and capture fork onto decode lanes
        with torch.cuda.stream(s):
            for _ in range(2):
                step(h, ids, pos, st.layers[0])
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            out = step(h, ids, pos, st.layers[0])
    graph = timed(g.replay, 50, warmup=5)
    launches = kernels_per_call(g.replay, reps=3)
    return {"layer_type": layer_type, "mode": mode, "active_weight_bytes": active, "eager_ms": eager * 1e3,
            "graph_ms": graph * 1e3, "graph_speedup": eager / graph, "floor_ms": active / ceiling * 1e3,
            "graph_over_floor": graph * ceiling / active, "eager_fraction_of_ceiling": active / eager / ceiling,
            "graph_fraction_of_ceiling": active / graph / ceiling, "kernels": mode != "reference",
            "kernels_per_step": launches["kernels"], "eager_kernels_per_step": eager_launches["kernels"],
            "graph_device_us": launches["device_us"], "top_kernels_us": launches["top_us"], "warm_s": warm_s,
            "format": fmt, "out_finite": bool(torch.isfinite(out).all())}


def bench_tiny(steps: int) -> dict:
    import dsv4lab
    from dsv4lab.decode.check import decode_check

    m = dsv4lab.load(device="cuda", dtype=torch.float32, progress=False)
    ids = torch.randint(2, m.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    from dsv4lab.decode.check import sync_inventory

    host_op = host_op_us(torch.device("cuda"))  # eager's floor on this host, next to the eager timing
    res = decode_check(m, ids, steps=steps).summary()
    res["host_op_us"] = host_op
    res["eager_over_host_op"] = res["median_step_ms_eager"] * 1e3 / host_op  # bare-op equivalents a step
    res["host_syncs_in_decode_step"] = sync_inventory(m, ids, steps=3)
    st = m.new_state(1, ids.shape[1] + 2 * steps + 16)  # eager + two layer-graph runs, with warm-ups
    m.prefill(ids.cuda(), st)
    tok = ids[:, -1:].cuda()
    eager = timed(lambda: m.decode_step(tok, st), steps // 2, [tok.device])
    res["layer_graphs"] = layer_graph_timing(m, st, tok, steps // 2, [tok.device], eager_ms=eager * 1e3)
    return res


def write(res: dict, path: Path | None) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, nargs="?", default=None, const=RESULTS / "decode.json",
                    help="write the results here (bare --json: benchmarks/results/decode.json)")
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--skip-tiny", action="store_true")
    ap.add_argument("--layer-modes", default="reference,kernels",
                    help="comma list of V4-Pro layer variants to time: reference, kernels, compiled (empty: none)")
    ap.add_argument("--cpu-smoke", action="store_true", help="build a shrunken layer on CPU and run one eager step")
    ap.add_argument("--format", choices=("nvfp4", "official"), default="nvfp4",
                    help="layer weights: NVFP4 (our users' engine) or the official MXFP4 experts + FP8-block")
    ap.add_argument("--helpers", choices=HELPERS, default="bf16",
                    help="compressor / indexer helper projections: BF16 (our users' engine) or quantised (the NVFP4 export)")
    args = ap.parse_args()
    bad = [m for m in args.layer_modes.split(",") if m and m not in LAYER_MODES]
    if bad:
        ap.error(f"--layer-modes: unknown mode {bad[0]!r}; choose from {', '.join(LAYER_MODES)}")
    if args.cpu_smoke:
        for lt in ("compressed_sparse_attention", "heavily_compressed_attention"):
            layer, cfg, active = build_layer(lt, torch.device("cpu"), small=True, fmt=args.format, helpers=args.helpers)
            st = DecodeState.allocate(cfg, 1, 512, torch.bfloat16, "cpu")
            st.pos_on("cpu").fill_(300)
            with torch.no_grad():
                out = layer.decode(torch.randn(1, 1, 4, cfg.hidden_size, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.long),
                                   st.pos_on("cpu"), st.layers[0])
            print(lt, tuple(out.shape), out.dtype, bool(torch.isfinite(out).all()), active)
        return
    dev = torch.device("cuda")
    ceiling = copy_ceiling(dev)
    # the floor treats the copy rate (bytes read + written per second) as what HBM can stream
    res = {"device": torch.cuda.get_device_name(dev), "copy_ceiling_GBps_read_plus_write": ceiling / 1e9}
    if not args.skip_tiny:
        res["tiny"] = bench_tiny(args.steps)
        print(json.dumps(res["tiny"]), flush=True)
        write(res, args.json)
    modes = [m for m in args.layer_modes.split(",") if m]
    for lt in ("compressed_sparse_attention", "heavily_compressed_attention"):
        for mode in modes:
            try:
                r = bench_layer(lt, dev, ceiling, mode, args.format, args.helpers)
                r["helpers"] = args.helpers
            except Exception as e:  # one failing variant (e.g. a compile error) must not lose the others
                r = {"layer_type": lt, "mode": mode, "error": f"{type(e).__name__}: {str(e)[:500]}"}
            res.setdefault("v4_pro_layer", []).append(r)
            print(json.dumps(r), flush=True)
            torch.cuda.empty_cache()
            write(res, args.json)  # after every variant: a call cut short keeps what ran


if __name__ == "__main__":
    main()
