"""The embedded model split across GPUs against one GPU: tokens, logits, load and step latency.

For each placement (all layers on the first device; the layers split into contiguous runs over
``--devices``): load the checkpoint (wall time, checkpoint bytes / s), prefill the prompt, then
``--steps`` greedy decode steps eagerly and (on CUDA) by CUDA-graph replay (``GraphDecoder``:
one graph per device, captured on explicit streams) from the same prefilled state. Every run is
compared with the single-device eager run: identical tokens, max |logit difference| per step
(bitwise equality expected: the same kernels run on the same data, only the device changes).

    python3 benchmarks/multi_gpu.py --json   # all visible GPUs, writes benchmarks/results/multi_gpu.json
    python3 benchmarks/multi_gpu.py --model data/tiny-dsv4/nvfp4 --json
    python3 benchmarks/multi_gpu.py --devices cpu,cpu --steps 8                 # CPU smoke (eager only)

Exit status 2 when a placement's tokens differ from the single-device run.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"  # default --json location

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def split_map(n_layers: int, devices: list[str]) -> list[str]:
    """Layer i on devices[i * len(devices) // n_layers]: contiguous, as even as the layers allow."""
    return [devices[i * len(devices) // n_layers] for i in range(n_layers)]


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _sync(devs) -> None:
    for d in {torch.device(d) for d in devs}:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


@torch.no_grad()
def run_placement(model_path: Path, device_map: list[str], prompt_ids: torch.Tensor, steps: int, dtype) -> dict:
    """Load with ``device_map``, prefill, ``steps`` eager steps and (CUDA) ``steps`` graph steps."""
    from dsv4lab.decode.check import run_steps
    from dsv4lab.loading import load

    _sync(device_map)
    t0 = time.perf_counter()
    model = load(model_path, device_map=device_map, dtype=dtype, progress=False)
    _sync(device_map)
    load_s = time.perf_counter() - t0
    dev = model.layer_devices()[0]
    ids = prompt_ids.to(dev)
    state = model.new_state(1, ids.shape[1] + steps + 1)
    first = model.prefill(ids, state)[:, -1].argmax(-1, keepdim=True)
    base = state.clone()
    out = {"device_map": device_map, "load_s": load_s,
           "load_MBps": checkpoint_bytes(model_path) / load_s / 1e6, "first_token": int(first[0, 0])}
    toks, logits, lat = run_steps(model, state, first, steps, model.decode_step)
    out["eager"] = {"tokens": toks, "logits": logits, "step_ms": lat}
    if all(torch.device(d).type == "cuda" for d in device_map):
        from dsv4lab.decode.graphs import GraphDecoder

        gd = GraphDecoder(model, base)
        t0 = time.perf_counter()
        gd.capture()
        capture_s = time.perf_counter() - t0
        toks, logits, lat = run_steps(model, base, first, steps, gd.step)
        out["graph"] = {"tokens": toks, "logits": logits, "step_ms": lat, "capture_s": capture_s,
                        "graphs": len(gd.segments)}
    del model
    return out


def compare(run: dict, ref: dict) -> dict:
    """Per mode of ``run``: tokens identical to the reference eager run, logit differences."""
    res = {}
    for mode in ("eager", "graph"):
        if mode not in run:
            continue
        r = run[mode]
        diffs = [float((a - b).abs().max()) for a, b in zip(r["logits"], ref["eager"]["logits"])]
        first_bad = next((i for i, (a, b) in enumerate(zip(r["tokens"], ref["eager"]["tokens"])) if a != b), None)
        lat = sorted(r["step_ms"])
        res[mode] = {"tokens_identical": first_bad is None and len(r["tokens"]) == len(ref["eager"]["tokens"]),
                     "first_token_mismatch": first_bad, "max_abs_logit_diff": max(diffs, default=0.0),
                     "bitwise_equal_steps": sum(d == 0.0 for d in diffs), "steps": len(diffs),
                     "median_step_ms": lat[len(lat) // 2], "p90_step_ms": lat[int(len(lat) * 0.9)]}
        if mode == "graph":
            res[mode].update(capture_s=r["capture_s"], graphs=r["graphs"])
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny model, BF16)")
    ap.add_argument("--devices", default=None, help="comma-separated devices to split over (default: all CUDA GPUs)")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--json", type=Path, nargs="?", default=None, const=RESULTS / "multi_gpu.json",
                    help="write the results here (bare --json: benchmarks/results/multi_gpu.json)")
    args = ap.parse_args(argv)
    from dsv4lab.cli.decode_check_cmd import prompt_ids as encode_prompt_ids
    from dsv4lab.config import load_config
    from dsv4lab.checkpoint.locate import resolve_path

    path = Path(resolve_path(args.model))
    devices = args.devices.split(",") if args.devices else [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if not devices:
        ap.error("no CUDA devices: pass --devices (e.g. cpu,cpu for the CPU smoke run)")
    cpu = all(torch.device(d).type == "cpu" for d in devices)
    dtype = torch.float32 if cpu else torch.bfloat16
    n_layers = load_config(path).num_hidden_layers
    prompt_ids = encode_prompt_ids(args.model, args.prompt)
    from dsv4lab.loading import load

    load(path, device=devices[0], dtype=dtype, progress=False)  # warm-up (imports, allocator, CUDA context), dropped
    single = run_placement(path, [devices[0]] * n_layers, prompt_ids, args.steps, dtype)
    split = run_placement(path, split_map(n_layers, devices), prompt_ids, args.steps, dtype)
    report = {"model": str(path), "devices": devices, "steps": args.steps, "prompt_tokens": int(prompt_ids.shape[1]),
              "device_names": [torch.cuda.get_device_name(torch.device(d)) for d in devices if torch.device(d).type == "cuda"]}
    for name, run in (("single", single), ("split", split)):
        report[name] = {"device_map": run["device_map"], "load_s": run["load_s"], "load_MBps": run["load_MBps"],
                        **compare(run, single)}
    ok = all(v["tokens_identical"] for name in ("single", "split") for k, v in report[name].items()
             if isinstance(v, dict) and "tokens_identical" in v)
    report["all_tokens_identical"] = ok
    print(json.dumps({k: v for k, v in report.items()}, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
