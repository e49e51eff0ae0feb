"""Full-depth model benchmark for the device machine (CUDA): random weights built on the GPU, no disk.

The V4 model (every layer, or the first ``--layers`` with ``--experts`` routed experts) is built
on the meta device and filled in place by :func:`dsv4lab.loading.materialize` with random
quantised weights (NVFP4, or the official FP8-block + MXFP4 experts), scaled as
``dsv4lab synth`` scales them (finite through all layers). Prints JSON: ms/token of the decode
step eager and as CUDA graphs, the graph capture time, prefill tokens/s at ``--context``; each
against its floor measured in the same run (decode: active weight bytes / device copy bandwidth;
prefill: 2 x active parameters x tokens / measured BF16 matmul rate, or the weight bytes if more).

    python3 benchmarks/full_model.py --preset v4-flash --experts 64 [--gpus 1] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.measure import copy_ceiling, kernels_per_call, matmul_rate, peak_extra_bytes, timed  # noqa: E402
from dsv4lab.checkpoint.expected import expected_tensors  # noqa: E402
from dsv4lab.checkpoint.fake import tiny_config  # noqa: E402
from dsv4lab.checkpoint.synth import Planned, master_tensor, preset_config, store_of  # noqa: E402
from dsv4lab.decode.graphs import GraphDecoder  # noqa: E402
from dsv4lab.loading import install_kernels_for_load, materialize  # noqa: E402
from dsv4lab.quant.weights import FP8BlockWeight, MXFP4Weight, NVFP4Weight  # noqa: E402

E2M1_RMS = 2.93       # RMS of uniformly random E2M1 codes (|values| 0 .. 6)
E4M3_RMS = 1.0        # randn cast to e4m3


def random_weight(name: str, out: int, inn: int, store: str, dev, g):
    """A random quantised (or BF16) weight of std ~ 1/sqrt(in), drawn on ``dev``."""
    std = inn ** -0.5
    if store == "nvfp4":
        packed = torch.randint(0, 256, (out, inn // 2), dtype=torch.uint8, device=dev, generator=g)
        scale = (torch.rand(out, inn // 16, device=dev, generator=g) + 0.5).to(torch.float8_e4m3fn)
        return NVFP4Weight(packed, scale, torch.tensor(std / E2M1_RMS, device=dev))
    if store == "mxfp4":
        packed = torch.randint(0, 256, (out, inn // 2), dtype=torch.uint8, device=dev, generator=g)
        exp = max(1, min(254, round(127 + torch.log2(torch.tensor(std / E2M1_RMS)).item())))
        return MXFP4Weight(packed, torch.full((out, inn // 32), exp, dtype=torch.uint8, device=dev))
    if store == "fp8_block":
        data = torch.randn(out, inn, device=dev, generator=g).to(torch.float8_e4m3fn)
        return FP8BlockWeight(data, torch.full((-(-out // 128), -(-inn // 128)), std / E4M3_RMS, device=dev))
    return (torch.randn(out, inn, device=dev, generator=g) * std).to(torch.bfloat16)


def build(cfg, fmt: str, devices: list, seed: int = 0):
    """The model on ``devices`` (one per layer), filled with random weights there."""
    expected = expected_tensors(cfg)
    gens: dict = {}

    def gen(dev):
        if str(dev) not in gens:
            gens[str(dev)] = torch.Generator(device=dev).manual_seed(seed)
        return gens[str(dev)]

    def get_weight(base: str, dev):
        shape, kind = expected[base + ".weight"]
        return random_weight(base, shape[0], shape[1], store_of(base + ".weight", kind, fmt), dev, gen(dev))

    def get_tensor(name: str, dev):
        shape, kind = expected[name]
        return master_tensor(cfg, Planned(name, shape, kind, store_of(name, kind, fmt)), seed, dev)

    return materialize(cfg, get_weight, get_tensor, dtype=torch.bfloat16, layer_devices=devices, progress=False)


def active_bytes(model, cfg) -> tuple[int, int]:
    """(weight bytes, parameters) one token touches: every linear but the routed experts, plus
    top-k of the routed experts of each layer, plus one embedding row."""
    nbytes = params = 0
    for name, ql in model.qlinears():
        b = ql.memory_bytes()
        n = ql.out_features * ql.in_features
        if ".mlp.experts." in name:
            b, n = b * cfg.num_experts_per_tok / cfg.n_routed_experts, n * cfg.num_experts_per_tok / cfg.n_routed_experts
        nbytes += b
        params += n
    return int(nbytes + cfg.hidden_size * 2), int(params)


@torch.no_grad()
def run(args) -> dict:
    cfg = preset_config(args.preset, layers=args.layers, experts=args.experts)
    n_gpu = args.gpus or torch.cuda.device_count()
    per = -(-cfg.num_hidden_layers // n_gpu)
    devices = [torch.device(f"cuda:{i // per}") for i in range(cfg.num_hidden_layers)]
    used = sorted({d for d in devices}, key=str)
    ceiling = min(copy_ceiling(d) for d in used)
    flops = min(matmul_rate(d) for d in used)
    t0 = time.perf_counter()
    model = build(cfg, args.format, devices, args.seed)
    build_s = time.perf_counter() - t0
    kernels = install_kernels_for_load(model, "auto" if args.kernels else False, devices)
    w_bytes, w_params = active_bytes(model, cfg)
    total_bytes = sum(ql.memory_bytes() for _, ql in model.qlinears())
    res = {"device": torch.cuda.get_device_name(used[0]), "gpus": len(used), "preset": args.preset,
           "format": args.format, "layers": cfg.num_hidden_layers, "experts": cfg.n_routed_experts,
           "kernels_installed": kernels, "build_s": build_s, "linear_weight_bytes": total_bytes,
           "active_weight_bytes_per_token": w_bytes, "copy_ceiling_GBps_read_plus_write": ceiling / 1e9,
           "bf16_matmul_TFLOPs": flops / 1e12}

    # prefill at --context, in chunks chosen from free memory (model.prefill_chunk) unless --chunk
    ids = torch.randint(0, cfg.vocab_size, (1, args.context), device=used[0], generator=torch.Generator(used[0]).manual_seed(0))
    state = model.new_state(1, args.context + 2 * args.steps + 16)  # eager and graph steps both advance it
    budget = int(2 * args.transient_gb * 1e9) if args.transient_gb else None  # prefill_chunk fits half of `free`
    chunk = args.chunk or model.prefill_chunk(args.context, free=budget)

    def prefill():
        state.set_pos(0)
        return model.prefill(ids, state, chunk=chunk)

    logits, extra = peak_extra_bytes(prefill, used[0])
    finite = bool(torch.isfinite(logits).all())
    del logits
    t_pre = timed(prefill, args.prefill_iters, used, warmup=0)
    compute_floor_s = 2 * w_params * args.context / flops
    pre_floor = max(compute_floor_s, total_bytes / ceiling)
    res["prefill"] = {"tokens": args.context, "chunk": chunk, "tokens_per_s": args.context / t_pre, "s": t_pre,
                      "floor_tokens_per_s": args.context / pre_floor, "fraction_of_floor": pre_floor / t_pre,
                      "peak_extra_GB_gpu0": extra / 1e9, "logits_finite": finite}
    res.update(prefill_tok_s=args.context / t_pre, prefill_compute_floor_tok_s=args.context / compute_floor_s,
               prefill_over_compute_floor=compute_floor_s / t_pre, prefill_peak_extra_GB=extra / 1e9)

    # decode after the prompt: eager, then graphs (and, with --compile, the step through torch.compile)
    state.set_pos(0)
    model.prefill(ids, state, chunk=chunk)
    step_ids = torch.zeros(1, 1, dtype=torch.long, device=used[0])
    eager = timed(lambda: model.decode_step(step_ids, state), args.steps, used)
    eager_launches = kernels_per_call(lambda: model.decode_step(step_ids, state), reps=1)
    gd = GraphDecoder(model, state)
    t0 = time.perf_counter()
    gd.capture()
    capture_s = time.perf_counter() - t0
    graph = timed(lambda: gd.step(step_ids, state), args.steps, used)
    graph_launches = kernels_per_call(lambda: gd.step(step_ids, state), reps=2)
    floor = w_bytes / ceiling
    out = gd.step(step_ids, state)
    res["decode"] = {"eager_ms_per_token": eager * 1e3, "graph_ms_per_token": graph * 1e3, "capture_s": capture_s,
                     "floor_ms_per_token": floor * 1e3, "eager_fraction_of_floor": floor / eager,
                     "graph_fraction_of_floor": floor / graph, "graph_speedup": eager / graph,
                     "eager_kernels_per_step": eager_launches["kernels"], "graph_launches": graph_launches,
                     "logits_finite": bool(torch.isfinite(out).all())}
    res.update(floor_ms=floor * 1e3, graph_ms=graph * 1e3, graph_over_floor=graph / floor, eager_ms=eager * 1e3,
               capture_s=capture_s, kernels_per_step=graph_launches["kernels"],
               kernels_per_layer=graph_launches["kernels"] / cfg.num_hidden_layers)
    if args.compile:
        res["compiled"] = compiled_decode(model, state, step_ids, args.steps, used, floor)
    return res


def compiled_decode(model, state, step_ids, steps: int, used, floor: float) -> dict:
    """``torch.compile`` of the decode step (Inductor fuses the PyTorch glue, as gpt-fast does),
    timed eagerly and inside one CUDA graph captured around the compiled step."""
    t0 = time.perf_counter()
    step = torch.compile(model.decode_step, dynamic=False)
    for _ in range(3):
        step(step_ids, state)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    eager = timed(lambda: step(step_ids, state), steps, used)
    dev = used[0]
    s = torch.cuda.Stream(device=dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        step(step_ids, state)
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            step(step_ids, state)
    torch.cuda.current_stream(dev).wait_stream(s)
    graph = timed(g.replay, steps, used)
    return {"compile_s": compile_s, "eager_ms": eager * 1e3, "graph_ms": graph * 1e3, "graph_over_floor": graph / floor,
            "kernels_per_step": kernels_per_call(g.replay, reps=2)["kernels"]}


@torch.no_grad()
def cpu_smoke(fmt: str) -> dict:
    """The same build, prefill and eager decode on a tiny config on the CPU (no timing)."""
    cfg = tiny_config(n_experts=8, moe_intermediate_size=32, hidden_size=64)
    model = build(cfg, fmt, [torch.device("cpu")] * cfg.num_hidden_layers)
    state = model.new_state(1, 40)
    ids = torch.randint(0, cfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    logits = model.prefill(ids, state)
    step = model.decode_step(ids[:, -1:], state)
    return {"format": fmt, "layers": cfg.num_hidden_layers, "active_weight_bytes_per_token": active_bytes(model, cfg)[0],
            "prefill_finite": bool(torch.isfinite(logits).all()), "decode_finite": bool(torch.isfinite(step).all()),
            "logits_std": float(logits.float().std())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="v4-flash", help="v4-flash (default) or v4-pro")
    ap.add_argument("--format", choices=("nvfp4", "official"), default="nvfp4")
    ap.add_argument("--layers", type=int, default=None, help="first N layers only (default all)")
    ap.add_argument("--experts", type=int, default=None, help="routed experts per layer (default the preset's)")
    ap.add_argument("--gpus", type=int, default=None, help="spread the layers over this many GPUs (default all)")
    ap.add_argument("--context", type=int, default=4096, help="prefill length (default 4096)")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per variant")
    ap.add_argument("--chunk", type=int, default=None, help="prefill chunk (default: from free memory)")
    ap.add_argument("--transient-gb", type=float, default=None,
                    help="choose the chunk so the prefill transient fits this many GB (default: half of free memory)")
    ap.add_argument("--prefill-iters", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile(decode_step), eager and in a graph")
    ap.add_argument("--no-kernels", dest="kernels", action="store_false", help="reference linears, no Triton kernels")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--cpu-smoke", action="store_true", help="build a tiny model on the CPU and run prefill + one step")
    args = ap.parse_args()
    res = cpu_smoke(args.format) if args.cpu_smoke else run(args)
    text = json.dumps(res, indent=1)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
