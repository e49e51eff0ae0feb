"""The full-scale recorded run (issue 19): a disk-backed V4-Pro-shaped synth on one GPU, run the way
a user runs the real model. Stages, each a subcommand writing one JSON under ``--out``:

    synth      write the NVFP4 synth and its official twin (generated on the GPU), then inspect
               and plan both (headers only)
    load       load the NVFP4 synth (page cache dropped first when allowed): seconds and GB/s,
               device memory measured vs the plan's prediction; graph capture; N decode steps
               graph vs eager
    notebooks  hold a ballast tensor so only ``--free-gb`` (default 18.9, the V4-Pro plan's fullest
               GPU) plus the model stay free, then run the triage notebooks with papermill on the
               synth (DEVICE=cuda, REFERENCE=the official twin); wall time and the least free
               device memory seen during each notebook
    soak       the embedded model: graph vs eager over many decode steps, memory growth

    python3 benchmarks/full_scale.py synth --ckpt /tmp/ckpt --experts 2 --out $OUT
    python3 benchmarks/full_scale.py notebooks --ckpt /tmp/ckpt --only 01 02 --out $OUT

Each stage is resumable: the synth skips a checkpoint already written (renamed from DIR.tmp).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dsv4lab.checkpoint.synth import preset_config, synth_checkpoint  # noqa: E402
from dsv4lab.decode.check import decode_check  # noqa: E402
from dsv4lab.loading import load  # noqa: E402
from dsv4lab.plan import plan  # noqa: E402
from dsv4lab.text import encode_prompt, load_tokenizer  # noqa: E402

V4_PRO_WORST_FREE_GB = 18.9   # `dsv4lab plan v4-pro --gpus 8 --gpu-memory 141GB`: headroom of GPU 2


def write_json(out: Path, name: str, obj: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    p = out / name
    p.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    print(json.dumps(obj, default=str)[:4000], flush=True)
    return p


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def cli_json(*args: str) -> dict:
    """``python -m dsv4lab ARGS --json`` -> its JSON (timed)."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "dsv4lab", *args, "--json"], capture_output=True, text=True, cwd=REPO)
    return {"argv": " ".join(args), "rc": r.returncode, "s": time.perf_counter() - t0,
            "json": json.loads(r.stdout) if r.returncode == 0 else None, "stderr": r.stderr[-2000:]}


def drop_page_cache() -> bool:
    """Cold reads for the load timing (root on the device machine); False where not allowed."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def checkpoints(args) -> tuple[Path, Path]:
    return Path(args.ckpt) / "pro-nvfp4", Path(args.official or (Path(args.ckpt) / "pro-official"))


# --------------------------------------------------------------------------- stages
def stage_synth(args) -> dict:
    nv, off = checkpoints(args)
    cfg = preset_config("v4-pro", layers=args.layers, experts=args.experts)
    res = {"preset": "v4-pro", "layers": cfg.num_hidden_layers, "experts": cfg.n_routed_experts,
           "top_k": cfg.num_experts_per_tok, "disk_free_before": shutil.disk_usage(Path(args.ckpt).parent).free}
    for fmt, path in (("nvfp4", nv), ("official", off)):
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            synth_checkpoint(path, cfg, fmt=fmt, seed=0, device="cuda", progress=False)
            s = time.perf_counter() - t0
        else:
            s = None
        nbytes = dir_bytes(path)
        res[fmt] = {"path": str(path), "bytes": nbytes, "write_s": s,
                    "GBps": None if s is None else nbytes / s / 1e9,
                    "inspect": cli_json("inspect", str(path)),
                    "plan": cli_json("plan", str(path), "--gpus", "1", "--gpu-memory", "141GB", "--context", "65536")}
    res["disk_free_after"] = shutil.disk_usage(Path(args.ckpt).parent).free
    return res


@torch.no_grad()
def stage_load(args) -> dict:
    nv, _ = checkpoints(args)
    cold = drop_page_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    model = load(str(nv), device="cuda", dtype=torch.bfloat16, progress=False)
    load_s = time.perf_counter() - t0
    weights_dev = torch.cuda.memory_allocated() - base
    state = model.new_state(1, args.context)
    measured = torch.cuda.memory_allocated() - base
    del state
    predicted = plan(str(nv), gpus=1, gpu_memory="141GB", context=args.context).to_dict()["gpus"][0]
    predicted.pop("layers", None)
    nbytes = dir_bytes(nv)
    res = {"cold_read": cold, "load_s": load_s, "checkpoint_bytes": nbytes, "load_GBps": nbytes / load_s / 1e9,
           "kernels_installed": model.load_stats.get("kernels") if hasattr(model, "load_stats") else None,
           "device_bytes_weights": weights_dev, "device_bytes_weights_plus_state": measured,
           "context": args.context, "plan_gpu0": predicted,
           "measured_over_predicted": measured / max(1, predicted.get("total", 0))}
    tok = load_tokenizer()
    ids = torch.tensor([tok.encode(encode_prompt("The capital of France is", "plain"), add_special_tokens=False)])
    check = decode_check(model, ids, steps=args.steps)
    res["decode"] = check.summary()
    res["decode"]["steps_compared"] = len(check.max_abs_diff)
    return res


class FreeMemoryWatch:
    """Polls device-wide free memory (cudaMemGetInfo sees every process) in a thread."""

    def __init__(self, period: float = 0.2) -> None:
        self.period, self.least, self._stop = period, None, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            free = torch.cuda.mem_get_info()[0]
            self.least = free if self.least is None else min(self.least, free)
            time.sleep(self.period)

    def __enter__(self) -> "FreeMemoryWatch":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def stage_notebooks(args) -> dict:
    from dsv4lab.triage.report import run_report  # lazy: papermill (carried wheels on the device)

    nv, off = checkpoints(args)
    model_bytes = int(plan(str(nv), gpus=1, gpu_memory="141GB", context=65536).to_dict()["gpus"][0]["total"])
    free, total = torch.cuda.mem_get_info()
    keep = int(args.free_gb * 1e9) + model_bytes
    ballast = max(0, free - keep)
    hold = torch.empty(ballast, dtype=torch.uint8, device="cuda")
    res = {"free_before_ballast": free, "total": total, "ballast_bytes": ballast, "model_bytes_planned": model_bytes,
           "free_after_ballast": torch.cuda.mem_get_info()[0], "target_free_gb_beside_model": args.free_gb,
           "notebooks": {}}
    params = {"REFERENCE": str(off)}
    for nb in args.only:
        with FreeMemoryWatch() as w:
            t0 = time.perf_counter()
            s = run_report(Path(args.out) / "report", model=str(nv), device="cuda", only=[nb], parameters=params,
                           html_export=False)
            wall = time.perf_counter() - t0
        entry = {"ok": s["ok"], "wall_s": wall, "least_free_bytes": w.least,
                 "least_free_beside_ballast_gb": None if w.least is None else w.least / 1e9}
        entry.update({k: v for k, v in s.items() if k not in ("ok",)})
        res["notebooks"][nb] = entry
        write_json(Path(args.out), f"h200_full_scale_notebooks_{nb}.json", entry)
    del hold
    return res


@torch.no_grad()
def stage_soak(args) -> dict:
    model = load(None, device="cuda", progress=False)
    tok = load_tokenizer()
    ids = torch.tensor([tok.encode(encode_prompt("The capital of France is", "plain"), add_special_tokens=False)])
    check = decode_check(model, ids, steps=args.steps)
    out = check.summary()
    out["steps_compared"] = len(check.max_abs_diff)
    out["all_steps_bitwise_equal"] = out["bitwise_equal_steps"] == args.steps
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", choices=("synth", "load", "notebooks", "soak"))
    ap.add_argument("--ckpt", default="/tmp/ckpt", help="where the synth checkpoints live")
    ap.add_argument("--official", default=None, help="the official twin's directory (default CKPT/pro-official)")
    ap.add_argument("--layers", type=int, default=None, help="V4-Pro layers (default all 61)")
    ap.add_argument("--experts", type=int, default=2, help="routed experts per layer (disk-bound)")
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=256, help="decode steps (load / soak)")
    ap.add_argument("--free-gb", type=float, default=V4_PRO_WORST_FREE_GB)
    ap.add_argument("--only", nargs="+", default=["01", "02", "03", "04", "05", "06", "07"])
    ap.add_argument("--out", default="benchmarks/results/full_scale")
    args = ap.parse_args()
    t0 = time.perf_counter()
    res = {"synth": stage_synth, "load": stage_load, "notebooks": stage_notebooks, "soak": stage_soak}[args.stage](args)
    res.update({"stage": args.stage, "argv": sys.argv[1:], "stage_s": time.perf_counter() - t0,
                "device": torch.cuda.get_device_name(), "torch": torch.__version__})
    suffix = "" if args.stage != "notebooks" else "_" + "-".join(args.only)
    write_json(Path(args.out), f"h200_full_scale_{args.stage}{suffix}.json", res)


if __name__ == "__main__":
    main()
