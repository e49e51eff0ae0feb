"""Full-depth model benchmark for the device machine (CUDA): random weights built on the GPUs, no disk.

The V4 model (every layer, or the first ``--layers`` with ``--experts`` routed experts) is built
on the meta device and filled in place by :func:`dsv4lab.loading.materialize` with random
quantised weights (NVFP4, or the official FP8-block + MXFP4 experts), scaled as ``dsv4lab synth``
scales them (finite through all layers), on ``--gpus N`` by the device map of ``dsv4lab.plan`` for
the config, format and decode state being built (embedding with layer 0; head, norm, hc_head with
the last layer: what ``dsv4lab.load(device_map=plan.device_map())`` does). Prints JSON: per GPU the
planned bytes, the bytes the model's tensors + state hold there and ``torch.cuda.memory_allocated``
after build + state (each over the plan), its copy rate and the weight bytes it reads per token;
ms/token of the decode step eager and as CUDA graphs, the graph capture time, prefill tokens/s at
each ``--context``; each against its floor measured in the same run:

* decode floor = SUM over GPUs of (bytes GPU g reads per token / g's copy rate). At batch 1 a
  token's layers run one GPU after another: GPU g+1 waits for g's hidden state, so their reading
  times add up. The MAX over GPUs (``floor_ms_pipelined``) is what a pipeline with a token in
  flight on every GPU (N sequences at once) could reach per token; one sequence cannot.
* prefill floor = the same sum of per-GPU max(2 x active parameters x tokens / BF16 matmul rate,
  weight bytes / copy rate).
* eager decode waits on the host, not the GPU: ``host_op_us`` (one bare torch op's host time,
  ``measure.host_op_us``) is measured next to it and ``eager_over_host_op`` states a token in those
  units, comparable across device machines whose hosts differ 2-3x in speed.

    python3 benchmarks/full_model.py --preset v4-flash --experts 64 [--gpus 1] [--json out.json]
    python3 benchmarks/full_model.py --preset v4-pro --gpus 8 --context 4096 32768 --out $OUT
    python3 benchmarks/full_model.py --cpu-smoke --preset v4-pro --fake-gpus 8   # the placement, on meta

``--out DIR`` writes ``DIR/full_model_<preset>_<format>_<N>gpu_<contexts>.json`` (``8gpu`` on eight
GPUs, e.g. ``full_model_v4-pro_nvfp4_8gpu_4k-32k.json``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.layer_graph_decode import layer_graph_timing  # noqa: E402
from benchmarks.measure import (copy_ceiling, host_op_us, kernels_per_call, matmul_rate,  # noqa: E402
                                peak_extra_bytes_by_device, synchronize, timed)
from dsv4lab.checkpoint.expected import expected_tensors  # noqa: E402
from dsv4lab.checkpoint.fake import tiny_config  # noqa: E402
from dsv4lab.checkpoint.names import layer_of  # noqa: E402
from dsv4lab.checkpoint.synth import Planned, master_tensor, preset_config, store_of  # noqa: E402
from dsv4lab.decode.graphs import GraphDecoder  # noqa: E402
from dsv4lab.kernels import launch  # noqa: E402
from dsv4lab.loading import device_for, install_kernels_for_load, materialize  # noqa: E402
from dsv4lab.model.state import DecodeState  # noqa: E402
from dsv4lab.plan import DEFAULT_RESERVE, MemoryPlan, plan  # noqa: E402
from dsv4lab.quant.weights import FP8BlockWeight, MXFP4Weight, NVFP4Weight  # noqa: E402

E2M1_RMS = 2.93       # RMS of uniformly random E2M1 codes (|values| 0 .. 6)
E4M3_RMS = 1.0        # randn cast to e4m3
PLAN_FORMAT = {"nvfp4": "nvfp4", "official": "fp8_mxfp4"}    # --format -> dsv4lab.plan's format
META_DTYPES = {"I32": torch.int32, "F32": torch.float32, "BF16": torch.bfloat16}
MEMORY_TOLERANCE = 0.05   # held / allocated bytes per GPU within 5 % of the plan


def random_weight(name: str, out: int, inn: int, store: str, dev, g):
    """A random quantised (or BF16) weight of std ~ 1/sqrt(in), drawn on ``dev`` (meta: shapes only)."""
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


def build(cfg, fmt: str, devices: list, seed: int = 0, asked: dict | None = None):
    """The model on ``devices`` (one per layer), filled with random weights there. On meta devices
    the tensors are empty (shapes and dtypes only). ``asked`` collects the device materialize asked
    for, per tensor name (``<linear>.weight`` for a linear's whole weight)."""
    expected = expected_tensors(cfg)
    gens: dict = {}

    def gen(dev):
        if torch.device(dev).type == "meta":
            return None
        if str(dev) not in gens:
            gens[str(dev)] = torch.Generator(device=dev).manual_seed(seed)
        return gens[str(dev)]

    def get_weight(base: str, dev):
        shape, kind = expected[base + ".weight"]
        if asked is not None:
            asked[base + ".weight"] = torch.device(dev)
        return random_weight(base, shape[0], shape[1], store_of(base + ".weight", kind, fmt), dev, gen(dev))

    def get_tensor(name: str, dev):
        shape, kind = expected[name]
        if asked is not None:
            asked[name] = torch.device(dev)
        p = Planned(name, shape, kind, store_of(name, kind, fmt))
        if torch.device(dev).type == "meta":
            return torch.empty(shape, dtype=META_DTYPES[p.store], device=dev)
        return master_tensor(cfg, p, seed, dev)

    return materialize(cfg, get_weight, get_tensor, dtype=torch.bfloat16, layer_devices=devices, progress=False)


# ------------------------------------------------------------------------------ placement
def plan_placement(cfg, fmt: str, gpus: int, context: int, gpu_memory="141GB", reserve=DEFAULT_RESERVE,
                   gpu_devices: list | None = None) -> tuple[MemoryPlan, list[torch.device]]:
    """``dsv4lab.plan`` of ``cfg`` in ``fmt`` over ``gpus`` GPUs holding a ``context``-token state,
    and its device map: one device per layer, ``gpu_devices[g]`` for planned GPU g (default
    ``cuda:g``). Raises ``PlanError`` (what would fit) before anything is built."""
    p = plan(cfg, gpus=gpus, gpu_memory=gpu_memory, context=context, fmt=PLAN_FORMAT[fmt], reserve=reserve)
    gpu_devices = gpu_devices or [torch.device("cuda", g) for g in range(gpus)]
    return p, [torch.device(d) for d in p.device_map(devices=gpu_devices)]


def planned_device(name: str, p: MemoryPlan, gpu_devices: list) -> torch.device:
    """The plan's GPU for a tensor: its layer's; the embedding with layer 0; the rest with the last layer."""
    i = layer_of(name)
    g = p.placement[i if i is not None else 0 if name.startswith("embed") else -1]
    return torch.device(gpu_devices[g])


def held_bytes(model, device_of: Callable | None = None) -> list[tuple[str, int, torch.device]]:
    """(name, bytes, device) of every tensor the model holds: quantised weights, parameters,
    buffers. ``device_of(name)`` replaces the tensor's own device (meta keeps no index); a name it
    gives None for is left out."""
    out = []
    tensors = [(f"{n}.weight", ql.qweight.nbytes, ql.qweight.device) for n, ql in model.qlinears() if ql.qweight is not None]
    tensors += [(n, t.numel() * t.element_size(), t.device)
                for n, t in list(model.named_parameters()) + list(model.named_buffers())]
    for name, nbytes, dev in tensors:
        if device_of is not None:
            dev = device_of(name)
            if dev is None:
                continue
        out.append((name, nbytes, torch.device(dev)))
    return out


def sum_by_device(items: Iterable[tuple[torch.device, int]]) -> dict[torch.device, int]:
    out: dict[torch.device, int] = {}
    for dev, n in items:
        out[dev] = out.get(dev, 0) + n
    return out


def state_by_device(state: DecodeState, devices: list) -> dict[torch.device, int]:
    """Decode-state bytes per device (layer i's buffers on ``devices[i]``)."""
    def layer_bytes(ls) -> int:
        ts = [ls.kv_ring] + [t for cs in (ls.compressor, ls.indexer) if cs is not None
                             for t in (cs.ring_kv, cs.ring_gate, cs.entries)]
        return sum(t.numel() * t.element_size() for t in ts)

    return sum_by_device((torch.device(d), layer_bytes(ls)) for d, ls in zip(devices, state.layers))


def misplaced(held: list[tuple[str, int, torch.device]], p: MemoryPlan, gpu_devices: list) -> list[str]:
    """Tensors not on the device the plan says (``name: on X, planned Y``)."""
    bad = []
    for name, _, dev in held:
        want = planned_device(name, p, gpu_devices)
        if dev != want:
            bad.append(f"{name}: on {dev}, planned {want}")
    return bad


def per_gpu_memory(p: MemoryPlan, gpu_devices: list, held: list, state: dict, allocated: dict | None = None) -> list[dict]:
    """Per planned GPU: planned bytes (weights + state), the bytes held there (model tensors +
    state) and, on CUDA, ``memory_allocated`` after build + state, each over the plan."""
    held_dev = sum_by_device((d, n) for _, n, d in held)
    rows = []
    for g, dev in enumerate(gpu_devices):
        dev = torch.device(dev)
        load = p.gpu_load(g)
        ls = p.layers_on(g)
        planned = load["weights"] + load["state"]
        h = held_dev.get(dev, 0) + state.get(dev, 0)
        row = {"gpu": g, "device": str(dev), "layers": f"{ls[0]}-{ls[-1]}" if ls else "",
               "with_embed": bool(ls) and ls[0] == 0, "with_head": bool(ls) and ls[-1] == p.num_layers - 1,
               "planned_bytes": planned, "planned_weight_bytes": load["weights"], "planned_state_bytes": load["state"],
               "planned_headroom_bytes": load["headroom"], "held_bytes": h,
               "held_over_planned": h / planned if planned else None}
        if allocated is not None:
            a = allocated.get(dev, 0)
            row.update(allocated_bytes=a, allocated_over_planned=a / planned if planned else None)
        rows.append(row)
    return rows


def within(rows: list[dict], key: str, tol: float = MEMORY_TOLERANCE) -> bool:
    """Every GPU that holds anything has ``key`` (a ratio to the plan) within ``tol`` of 1."""
    return all(abs(r[key] - 1) <= tol for r in rows if r["planned_bytes"] and r.get(key) is not None)


@torch.no_grad()
def placement_check(cfg, fmt: str, gpus: int, context: int, gpu_memory="141GB", reserve=DEFAULT_RESERVE) -> dict:
    """The model built on the meta device with the plan's device map over ``gpus`` fake GPUs
    (``meta:g``; a meta tensor drops the index, so each tensor's device is the one materialize
    asked for): every tensor on its planned GPU, and per GPU the bytes the model's tensors + the
    decode state hold within 5 % of the plan (the check the CUDA run makes with real memory)."""
    fake = [torch.device("meta", g) for g in range(gpus)]
    t0 = time.perf_counter()
    p, devices = plan_placement(cfg, fmt, gpus, context, gpu_memory, reserve, fake)
    asked: dict = {}
    model = build(cfg, fmt, devices, asked=asked)
    held = held_bytes(model, asked.get)
    state = DecodeState.allocate(cfg, 1, context, torch.bfloat16, devices)
    rows = per_gpu_memory(p, fake, held, state_by_device(state, devices))
    bad = misplaced(held, p, fake)
    unasked = sorted({n for n, _, _ in held_bytes(model) if not n.endswith("inv_freq")} - set(asked))
    ok = not bad and not unasked and within(rows, "held_over_planned") and len(asked) == len(held)
    return {"check": "placement on meta", "preset_layers": cfg.num_hidden_layers, "experts": cfg.n_routed_experts,
            "format": fmt, "gpus": gpus, "context": context, "gpu_memory": str(gpu_memory),
            "device_map": device_map_ranges(p), "placement": p.placement, "tensors": len(held),
            "misplaced": bad[:20], "misplaced_count": len(bad), "not_asked": unasked[:20],
            "per_gpu": rows, "max_abs_held_deviation": max_deviation(rows, "held_over_planned"),
            "placement_ok": ok, "check_s": time.perf_counter() - t0}


def device_map_ranges(p: MemoryPlan) -> dict[str, str]:
    """``{"cuda:g": "first-last"}`` for every GPU that holds layers."""
    out = {}
    for g in range(p.gpus):
        ls = p.layers_on(g)
        if ls:
            out[f"cuda:{g}"] = f"{ls[0]}-{ls[-1]}"
    return out


def max_deviation(rows: list[dict], key: str) -> float | None:
    vals = [abs(r[key] - 1) for r in rows if r.get(key) is not None]
    return max(vals) if vals else None


# ------------------------------------------------------------------------------ reads per token
def read_bytes(model, cfg, devices: list) -> dict[torch.device, dict[str, float]]:
    """Per device: the weight bytes and parameters one token reads (every linear but the routed
    experts, top-k of each layer's routed experts, one embedding row on the first device) and the
    bytes of all its linears (what a long prefill reads)."""
    out: dict[torch.device, dict[str, float]] = {}
    first, last = devices[0], devices[-1]
    for name, ql in model.qlinears():
        d = out.setdefault(torch.device(device_for(name, devices, first, last)),
                           {"bytes": 0.0, "params": 0.0, "linear_bytes": 0.0})
        b = ql.memory_bytes()
        n = ql.out_features * ql.in_features
        d["linear_bytes"] += b
        if ".mlp.experts." in name:
            b, n = b * cfg.num_experts_per_tok / cfg.n_routed_experts, n * cfg.num_experts_per_tok / cfg.n_routed_experts
        d["bytes"] += b
        d["params"] += n
    out.setdefault(torch.device(first), {"bytes": 0.0, "params": 0.0, "linear_bytes": 0.0})["bytes"] += cfg.hidden_size * 2
    return out


def active_bytes(model, cfg) -> tuple[int, int]:
    """(weight bytes, parameters) one token touches, over all devices (see :func:`read_bytes`)."""
    per = read_bytes(model, cfg, model.layer_devices()).values()
    return int(sum(d["bytes"] for d in per)), int(sum(d["params"] for d in per))


def stack_experts(model) -> None:
    """Stack every layer's routed experts now (decode gathers from the stack; built lazily
    otherwise): one layer's transient at a time, so the memory measured after is the steady state."""
    for layer in model.layers:
        layer.mlp.experts.stack()


def result_name(preset: str, fmt: str, gpus: int, contexts: Iterable[int] = ()) -> str:
    """``full_model_<preset>_<format>_<N>gpu[_<contexts>].json``: ``8gpu`` in the name of an
    eight-GPU run, the prefill lengths (``4k-32k``) when given."""
    ctx = "-".join(f"{c // 1024}k" if c % 1024 == 0 else str(c) for c in contexts)
    return f"full_model_{preset}_{fmt}_{gpus}gpu" + (f"_{ctx}" if ctx else "") + ".json"


# ------------------------------------------------------------------------------ the CUDA run
@torch.no_grad()
def run(args) -> dict:
    cfg = preset_config(args.preset, layers=args.layers, experts=args.experts)
    n_gpu = args.gpus or torch.cuda.device_count()
    contexts = list(args.context)
    state_len = max(contexts) + 4 * args.steps + 64  # eager, graph and layer-graph steps (+ warm-ups) advance it
    gpu_devs = [torch.device("cuda", g) for g in range(n_gpu)]
    p, devices = plan_placement(cfg, args.format, n_gpu, state_len, args.gpu_memory, args.reserve, gpu_devs)
    used = list(dict.fromkeys(devices))  # in layer order
    ceiling = {d: copy_ceiling(d) for d in used}
    flops = {d: matmul_rate(d) for d in used}
    for d in used:
        with torch.cuda.device(d):
            torch.cuda.empty_cache()  # the copy-rate buffers go back before 100+ GB are built
    base = {d: torch.cuda.memory_allocated(d) for d in gpu_devs}
    t0 = time.perf_counter()
    model = build(cfg, args.format, devices, args.seed)
    synchronize(used)
    build_s = time.perf_counter() - t0
    kernels = install_kernels_for_load(model, "auto" if args.kernels else False, devices)
    stack_experts(model)
    state = model.new_state(1, state_len)
    synchronize(used)
    allocated = {d: torch.cuda.memory_allocated(d) - base[d] for d in gpu_devs}
    held = held_bytes(model)
    rows = per_gpu_memory(p, gpu_devs, held, state_by_device(state, devices), allocated)
    bad = misplaced(held, p, gpu_devs)
    reads = read_bytes(model, cfg, devices)
    for r in rows:
        d = torch.device(r["device"])
        rd = reads.get(d, {"bytes": 0.0, "params": 0.0, "linear_bytes": 0.0})
        r.update(copy_GBps_read_plus_write=ceiling[d] / 1e9 if d in ceiling else None,
                 bf16_matmul_TFLOPs=flops[d] / 1e12 if d in flops else None,
                 read_bytes_per_token=int(rd["bytes"]), linear_weight_bytes=int(rd["linear_bytes"]),
                 floor_ms=rd["bytes"] / ceiling[d] * 1e3 if d in ceiling else 0.0)
    w_bytes = int(sum(r["bytes"] for r in reads.values()))
    floor = sum(reads[d]["bytes"] / ceiling[d] for d in used)            # one GPU after another
    floor_pipelined = max(reads[d]["bytes"] / ceiling[d] for d in used)  # every GPU busy at once
    res = {"device": torch.cuda.get_device_name(used[0]), "gpus": n_gpu, "gpus_used": len(used),
           "preset": args.preset, "format": args.format, "layers": cfg.num_hidden_layers,
           "experts": cfg.n_routed_experts, "gpu_memory_planned": str(args.gpu_memory), "reserve": args.reserve,
           "state_tokens": state_len, "device_map": device_map_ranges(p), "placement": p.placement,
           "kernels_installed": kernels, "build_s": build_s,
           "linear_weight_bytes": sum(r["linear_weight_bytes"] for r in rows),
           "active_weight_bytes_per_token": w_bytes,
           "copy_ceiling_GBps_read_plus_write": min(ceiling.values()) / 1e9,
           "bf16_matmul_TFLOPs": min(flops.values()) / 1e12, "per_gpu": rows,
           "misplaced": bad[:20], "misplaced_count": len(bad),
           "max_abs_allocated_deviation": max_deviation(rows, "allocated_over_planned"),
           "max_abs_held_deviation": max_deviation(rows, "held_over_planned"),
           "memory_within_5pct": within(rows, "allocated_over_planned"), "floor_ms_pipelined": floor_pipelined * 1e3}

    # prefill at each --context, in chunks chosen from free memory (model.prefill_chunk) unless --chunk
    budget = int(2 * args.transient_gb * 1e9) if args.transient_gb else None  # prefill_chunk fits half of `free`
    gen = torch.Generator(used[0]).manual_seed(0)
    by_ctx, prof = [], {}
    for T in contexts:
        ids = torch.randint(0, cfg.vocab_size, (1, T), device=used[0], generator=gen)
        chunk = args.chunk or model.prefill_chunk(T, free=budget)

        def prefill():
            state.set_pos(0)
            return model.prefill(ids, state, chunk=chunk, last_only=True)

        logits, extra = peak_extra_bytes_by_device(prefill, used)
        finite = bool(torch.isfinite(logits).all())
        del logits
        t_pre = timed(prefill, args.prefill_iters, used, warmup=0)
        compute_s = sum(2 * reads[d]["params"] * T / flops[d] for d in used)
        floor_s = sum(max(2 * reads[d]["params"] * T / flops[d], reads[d]["linear_bytes"] / ceiling[d]) for d in used)
        if args.profile:  # the whole prefill's kernels by device time (one more pass)
            prof[str(T)] = kernels_per_call(prefill, reps=1, top=30, devices=used)
        by_ctx.append({"tokens": T, "chunk": chunk, "tokens_per_s": T / t_pre, "s": t_pre,
                       "floor_tokens_per_s": T / floor_s, "fraction_of_floor": floor_s / t_pre,
                       "compute_floor_tokens_per_s": T / compute_s, "over_compute_floor": compute_s / t_pre,
                       "peak_extra_GB_by_gpu": {str(d): e / 1e9 for d, e in zip(used, extra)},
                       "peak_extra_GB_gpu0": extra[0] / 1e9, "logits_finite": finite})
    first = by_ctx[0]
    if prof:
        res["prefill_kernels"] = prof
    res["prefill"] = first
    res["prefill_by_context"] = by_ctx
    res.update(prefill_tok_s=first["tokens_per_s"], prefill_compute_floor_tok_s=first["compute_floor_tokens_per_s"],
               prefill_over_compute_floor=first["over_compute_floor"], prefill_peak_extra_GB=max(
                   first["peak_extra_GB_by_gpu"].values()),
               prefill_tok_s_by_context={str(x["tokens"]): x["tokens_per_s"] for x in by_ctx})

    # decode after the first context's prompt: eager, then graphs (and, with --compile, torch.compile)
    T = contexts[0]
    ids = torch.randint(0, cfg.vocab_size, (1, T), device=used[0], generator=torch.Generator(used[0]).manual_seed(0))
    state.set_pos(0)
    model.prefill(ids, state, chunk=args.chunk or model.prefill_chunk(T, free=budget), last_only=True)
    step_ids = torch.zeros(1, 1, dtype=torch.long, device=used[0])
    host_op = host_op_us(used[0])  # eager waits on the host: its floor there, measured next to it
    normal0, warm = launch.normal_by_kernel.copy(), 3
    eager = timed(lambda: model.decode_step(step_ids, state), args.steps, used, warmup=warm)
    eager_normal = {k: v / (args.steps + warm) for k, v in (launch.normal_by_kernel - normal0).most_common()}
    eager_launches = kernels_per_call(lambda: model.decode_step(step_ids, state), reps=1, devices=used)
    gd = GraphDecoder(model, state)
    t0 = time.perf_counter()
    gd.capture()
    capture_s = time.perf_counter() - t0
    graph = timed(lambda: gd.step(step_ids, state), args.steps, used)
    graph_launches = kernels_per_call(lambda: gd.step(step_ids, state), reps=2, devices=used)
    out = gd.step(step_ids, state)
    res["decode"] = {"after_tokens": T, "eager_ms_per_token": eager * 1e3, "graph_ms_per_token": graph * 1e3,
                     "capture_s": capture_s, "graphs": len(gd.segments), "floor_ms_per_token": floor * 1e3,
                     "eager_fraction_of_floor": floor / eager, "graph_fraction_of_floor": floor / graph,
                     "graph_speedup": eager / graph, "eager_kernels_per_step": eager_launches["kernels"],
                     "graph_launches": graph_launches, "logits_finite": bool(torch.isfinite(out).all()),
                     # launches a step through Triton's Python launcher instead of the direct path (host time)
                     "eager_normal_launches_per_step": sum(eager_normal.values()),
                     "eager_normal_by_kernel": eager_normal}
    res.update(host_op_us=host_op, eager_over_host_op=eager * 1e6 / host_op)
    res.update(floor_ms=floor * 1e3, graph_ms=graph * 1e3, graph_over_floor=graph / floor, eager_ms=eager * 1e3,
               capture_s=capture_s, kernels_per_step=graph_launches["kernels"],
               kernels_per_layer=graph_launches["kernels"] / cfg.num_hidden_layers)
    del gd  # its pool goes back before the layer graphs are captured
    lg = layer_graph_timing(model, state, step_ids, args.steps, used, eager_ms=eager * 1e3, floor_ms=floor * 1e3)
    res["layer_graphs"] = lg
    res.update(layer_graph_ms=lg["ms_per_token"], hooked_ms=lg["hooked_ms_per_token"])
    if args.compile:
        res["compiled"] = (compiled_decode(model, state, step_ids, args.steps, used, floor) if len(used) == 1
                           else {"skipped": "one CUDA graph around the compiled step needs one GPU"})
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
    """The same build, prefill, eager and layer-graph decode on a tiny config on the CPU (timing
    means nothing here; the hooked layer and the hook's firing are what is checked)."""
    cfg = tiny_config(n_experts=8, moe_intermediate_size=32, hidden_size=64)
    model = build(cfg, fmt, [torch.device("cpu")] * cfg.num_hidden_layers)
    state = model.new_state(1, 40)
    ids = torch.randint(0, cfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    logits = model.prefill(ids, state)
    base = state.clone()
    step = model.decode_step(ids[:, -1:], state)
    layer_graph = layer_graph_timing(model, base, ids[:, -1:], steps=1, devices=[])
    return {"format": fmt, "layers": cfg.num_hidden_layers, "active_weight_bytes_per_token": active_bytes(model, cfg)[0],
            "prefill_finite": bool(torch.isfinite(logits).all()), "decode_finite": bool(torch.isfinite(step).all()),
            "layer_graph_hooked_units": layer_graph["eager_units_hooked"], "layer_graph_hook_fired": layer_graph["hook_fired"],
            "logits_std": float(logits.float().std())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="v4-flash", help="v4-flash (default) or v4-pro")
    ap.add_argument("--format", choices=("nvfp4", "official"), default="nvfp4")
    ap.add_argument("--layers", type=int, default=None, help="first N layers only (default all)")
    ap.add_argument("--experts", type=int, default=None, help="routed experts per layer (default the preset's)")
    ap.add_argument("--gpus", type=int, default=None, help="place the layers over this many GPUs by the plan (default all)")
    ap.add_argument("--gpu-memory", default="141GB", help="per-GPU capacity the plan places against (default 141GB)")
    ap.add_argument("--reserve", default=DEFAULT_RESERVE, help="bytes the plan keeps free per GPU (default 6GB)")
    ap.add_argument("--context", type=int, nargs="+", default=[4096],
                    help="prefill lengths, each timed (default 4096); decode follows the first")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per variant")
    ap.add_argument("--chunk", type=int, default=None, help="prefill chunk (default: from free memory)")
    ap.add_argument("--transient-gb", type=float, default=None,
                    help="choose the chunk so the prefill transient fits this many GB (default: half of free memory)")
    ap.add_argument("--prefill-iters", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="also list each prefill's kernels by device time")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile(decode_step), eager and in a graph")
    ap.add_argument("--no-kernels", dest="kernels", action="store_false", help="reference linears, no Triton kernels")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--out", type=Path, default=None, help="also write DIR/full_model_<preset>_<format>_<N>gpu_<contexts>.json")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="build a tiny model on the CPU and run prefill + one step; with --fake-gpus: the placement on meta")
    ap.add_argument("--fake-gpus", type=int, default=None,
                    help="with --cpu-smoke: build the preset on the meta device over N fake GPUs by the plan and "
                         "check placement and bytes per GPU (exit 2 when they disagree)")
    args = ap.parse_args(argv)
    if args.fake_gpus is not None and not args.cpu_smoke:
        ap.error("--fake-gpus goes with --cpu-smoke (on CUDA, --gpus N places over real GPUs)")
    if args.fake_gpus is not None:
        cfg = preset_config(args.preset, layers=args.layers, experts=args.experts)
        res = placement_check(cfg, args.format, args.fake_gpus, max(args.context) + 2 * args.steps + 16,
                              args.gpu_memory, args.reserve)
        res["preset"] = args.preset
        name = "placement_" + result_name(args.preset, args.format, args.fake_gpus)
    elif args.cpu_smoke:
        res, name = cpu_smoke(args.format), None
    else:
        res = run(args)
        name = result_name(args.preset, args.format, res["gpus"], args.context)
    text = json.dumps(res, indent=1)
    print(text)
    for path in (args.json, None if args.out is None or name is None else args.out / name):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n")
    return 2 if res.get("placement_ok") is False else 0


if __name__ == "__main__":
    sys.exit(main())
