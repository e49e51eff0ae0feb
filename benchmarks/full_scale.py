"""The full-scale recorded run (issue 19): a disk-backed V4-Pro-shaped synth on one GPU, run the way
a user runs the real model. Stages, each a subcommand writing one JSON under ``--out``:

    synth      write the NVFP4 synth and its official twin (generated on the GPU), then inspect
               and plan both (headers only)
    load       load the NVFP4 synth (page cache dropped first when allowed) over ``--gpus N`` by
               the device map of ``dsv4lab.plan`` (the streaming loader: each tensor read once,
               straight to its GPU): seconds, GB/s, peak host memory (RSS sampled during the load,
               and VmHWM), device memory per GPU measured vs the plan's prediction; graph capture;
               N decode steps graph vs eager. ``--cpu-smoke``: the same over N CPU devices
               (cpu:0..N-1) on the embedded NVFP4 model, no device memory
    notebooks  hold a ballast tensor so only ``--free-gb`` (default 18.9, the V4-Pro plan's fullest
               GPU) plus the model stay free, then run the triage notebooks with papermill on the
               synth (DEVICE=cuda, REFERENCE=the official twin); wall time and the least free
               device memory seen during each notebook
    soak       the embedded model: graph vs eager over many decode steps, memory growth

    python3 benchmarks/full_scale.py synth --ckpt /tmp/ckpt --experts 2 --out $OUT
    python3 benchmarks/full_scale.py notebooks --ckpt /tmp/ckpt --only 01 02 --out $OUT
    python3 benchmarks/full_scale.py load --ckpt /tmp/ckpt --gpus 8 --out $OUT     # h200_full_scale_load_8gpu.json
    python3 benchmarks/full_scale.py load --cpu-smoke --gpus 3 --steps 2 --out /tmp/x

Each stage is resumable: the synth skips a checkpoint already written (renamed from DIR.tmp).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dsv4lab.checkpoint.locate import resolve_path  # noqa: E402
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
        if fmt not in args.formats:
            continue
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            synth_checkpoint(path, cfg, fmt=fmt, seed=0, device="cuda", progress=False)
            s = time.perf_counter() - t0
        else:
            s = None
        nbytes = dir_bytes(path)
        res[fmt] = {"path": str(path), "bytes": nbytes, "write_s": s,
                    "GBps": None if s is None else nbytes / s / 1e9}
        if not args.no_inspect:
            res[fmt]["inspect"] = cli_json("inspect", str(path))
            res[fmt]["plan"] = cli_json("plan", str(path), "--gpus", str(args.gpus), "--gpu-memory",
                                        args.gpu_memory, "--context", "65536")
    res["disk_free_after"] = shutil.disk_usage(Path(args.ckpt).parent).free
    return res


class HostMemoryWatch:
    """Peak host memory of this process while open: resident set (``VmRSS``, file pages the
    safetensors mmaps map included) and anonymous memory (``RssAnon``: what the loader itself
    allocates) sampled in a thread, and the kernel's high-water mark ``VmHWM`` (reset on entry
    where ``/proc/self/clear_refs`` allows). Linux ``/proc``; elsewhere ``resource.ru_maxrss``."""

    def __init__(self, period: float = 0.01) -> None:
        self.period, self._stop = period, threading.Event()
        self.before: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.hwm_reset = False
        self._t = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def status() -> dict[str, int]:
        try:
            with open("/proc/self/status") as f:
                return {k: int(v.split()[0]) * 1024 for k, _, v in (ln.partition(":") for ln in f)
                        if k in ("VmRSS", "RssAnon", "VmHWM")}
        except OSError:
            return {"VmHWM": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

    def _sample(self) -> None:
        for k, v in self.status().items():
            self.peak[k] = max(self.peak.get(k, 0), v)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.period)

    def __enter__(self) -> "HostMemoryWatch":
        try:
            Path("/proc/self/clear_refs").write_text("5\n")  # VmHWM := VmRSS
            self.hwm_reset = True
        except OSError:
            pass
        self.before = self.status()
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self._sample()

    def summary(self) -> dict:
        b, p = self.before, self.peak
        return {"rss_before": b.get("VmRSS"), "peak_rss": p.get("VmRSS"), "peak_rss_anon": p.get("RssAnon"),
                "peak_rss_over_before": None if "VmRSS" not in b else p["VmRSS"] - b["VmRSS"],
                "peak_anon_over_before": None if "RssAnon" not in b else p["RssAnon"] - b["RssAnon"],
                "vm_hwm": p.get("VmHWM"), "vm_hwm_reset_at_start": self.hwm_reset}


def load_devices(gpus: int, cpu: bool) -> list[torch.device]:
    """The devices a load is placed over: ``cuda:0..N-1``, or N distinct CPU devices for the smoke run."""
    return [torch.device("cpu" if cpu else "cuda", g) for g in range(gpus)]


def device_memory(devices: list[torch.device]) -> dict[torch.device, int]:
    return {d: torch.cuda.memory_allocated(d) if d.type == "cuda" else 0 for d in devices}


@torch.no_grad()
def stage_load(args) -> dict:
    nv = Path(resolve_path("tiny-nvfp4")) if args.cpu_smoke else checkpoints(args)[0]
    gpus = load_devices(args.gpus, args.cpu_smoke)
    cuda = not args.cpu_smoke
    cold = drop_page_cache()
    p = plan(str(nv), gpus=args.gpus, gpu_memory=args.gpu_memory, context=args.context)
    device_map = p.device_map(devices=gpus)
    used = list(dict.fromkeys(torch.device(d) for d in device_map))
    if cuda:
        for d in used:
            torch.cuda.reset_peak_memory_stats(d)
    base = device_memory(gpus)
    with HostMemoryWatch() as host:
        t0 = time.perf_counter()
        model = load(str(nv), device_map=device_map, dtype=torch.bfloat16, progress=False)
        if cuda:
            for d in used:
                torch.cuda.synchronize(d)
        load_s = time.perf_counter() - t0
    after_weights = device_memory(gpus)
    state = model.new_state(1, args.context)
    after_state = device_memory(gpus)
    del state
    per_gpu = []
    for g, d in enumerate(gpus):
        pred = p.gpu_load(g)
        ls = p.layers_on(g)
        planned = pred["weights"] + pred["state"]
        measured = after_state[d] - base[d]
        per_gpu.append({"gpu": g, "device": str(d), "layers": f"{ls[0]}-{ls[-1]}" if ls else "",
                        "planned_bytes": planned, "planned_weight_bytes": pred["weights"],
                        "planned_state_bytes": pred["state"], "planned_headroom_bytes": pred["headroom"],
                        "device_bytes_weights": after_weights[d] - base[d], "device_bytes_weights_plus_state": measured,
                        "measured_over_predicted": measured / planned if cuda and planned else None})
    nbytes = dir_bytes(nv)
    measured = sum(r["device_bytes_weights_plus_state"] for r in per_gpu)
    planned = sum(r["planned_bytes"] for r in per_gpu)
    gpu0 = p.to_dict()["gpus"][0]
    gpu0.pop("layers", None)
    res = {"cold_read": cold, "load_s": load_s, "checkpoint_bytes": nbytes, "load_GBps": nbytes / load_s / 1e9,
           "gpus": args.gpus, "gpus_used": len(used),
           "device_map": {r["device"]: r["layers"] for r in per_gpu if r["layers"]},
           "host_memory": host.summary(), "per_gpu": per_gpu,
           "kernels_installed": model.load_stats.get("kernels") if hasattr(model, "load_stats") else None,
           "device_bytes_weights": sum(r["device_bytes_weights"] for r in per_gpu),
           "device_bytes_weights_plus_state": measured, "context": args.context, "plan_gpu0": gpu0,
           "measured_over_predicted": measured / max(1, planned) if cuda else None,
           "max_abs_deviation_per_gpu": max((abs(r["measured_over_predicted"] - 1) for r in per_gpu
                                             if r["measured_over_predicted"] is not None), default=None)}
    if args.steps:
        tok = load_tokenizer()
        ids = torch.tensor([tok.encode(encode_prompt("The capital of France is", "plain"), add_special_tokens=False)])
        check = decode_check(model, ids, steps=args.steps)
        res["decode"] = check.summary()
        res["decode"]["steps_compared"] = len(check.max_abs_diff)
    return res


class FreeMemoryWatch:
    """Polls device-wide free memory (cudaMemGetInfo sees every process) of ``devices`` in a thread;
    ``least``: the least seen on the first, ``least_by_device``: on each."""

    def __init__(self, period: float = 0.2, devices: list[int] | None = None) -> None:
        self.period, self._stop = period, threading.Event()
        self.devices = devices or [torch.cuda.current_device()]
        self.least_by_device: dict[int, int] = {}
        self._t = threading.Thread(target=self._run, daemon=True)

    @property
    def least(self) -> int | None:
        return self.least_by_device.get(self.devices[0])

    def _run(self) -> None:
        while not self._stop.is_set():
            for d in self.devices:
                free = torch.cuda.mem_get_info(d)[0]
                self.least_by_device[d] = min(self.least_by_device.get(d, free), free)
            time.sleep(self.period)

    def __enter__(self) -> "FreeMemoryWatch":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def stage_notebooks(args) -> dict:
    """One GPU: ballast so only ``--free-gb`` beside the model stays free (the V4-Pro plan's fullest
    GPU). ``--gpus N`` > 1: the notebooks place the model themselves (``DEVICE="auto"``: the plan's
    device map over the visible GPUs), no ballast; the least free memory per GPU is recorded."""
    from dsv4lab.triage.report import run_report  # lazy: papermill (carried wheels on the device)

    nv, off = checkpoints(args)
    multi = args.gpus > 1
    loads = plan(str(nv), gpus=args.gpus, gpu_memory=args.gpu_memory, context=65536).to_dict()["gpus"]
    model_bytes = int(loads[0]["total"])
    free, total = torch.cuda.mem_get_info()
    keep = int(args.free_gb * 1e9) + model_bytes
    ballast = 0 if multi else max(0, free - keep)
    hold = torch.empty(ballast, dtype=torch.uint8, device="cuda")
    res = {"free_before_ballast": free, "total": total, "ballast_bytes": ballast, "model_bytes_planned": model_bytes,
           "model_bytes_planned_by_gpu": [int(x["total"]) for x in loads],
           "free_after_ballast": torch.cuda.mem_get_info()[0], "target_free_gb_beside_model": args.free_gb,
           "device": "auto" if multi else "cuda", "notebooks": {}}
    params = {"REFERENCE": str(off)}
    for nb in args.only:
        with FreeMemoryWatch(devices=list(range(args.gpus))) as w:
            t0 = time.perf_counter()
            s = run_report(Path(args.out) / "report", model=str(nv), device=res["device"], only=[nb],
                           parameters=params, html_export=False)
            wall = time.perf_counter() - t0
        entry = {"ok": s["ok"], "wall_s": wall, "least_free_bytes": w.least,
                 "least_free_beside_ballast_gb": None if w.least is None else w.least / 1e9,
                 "least_free_gb_by_gpu": {str(d): v / 1e9 for d, v in w.least_by_device.items()}}
        entry.update({k: v for k, v in s.items() if k not in ("ok",)})
        res["notebooks"][nb] = entry
        write_json(Path(args.out), result_name(args, nb), entry)
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", choices=("synth", "load", "notebooks", "soak"))
    ap.add_argument("--ckpt", default="/tmp/ckpt", help="where the synth checkpoints live")
    ap.add_argument("--official", default=None, help="the official twin's directory (default CKPT/pro-official)")
    ap.add_argument("--layers", type=int, default=None, help="V4-Pro layers (default all 61)")
    ap.add_argument("--experts", type=int, default=2, help="routed experts per layer (disk-bound)")
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--gpus", type=int, default=1, help="load: place over this many GPUs by the plan's device map")
    ap.add_argument("--gpu-memory", default="141GB", help="per-GPU capacity the plan places against")
    ap.add_argument("--formats", nargs="+", choices=("nvfp4", "official"), default=["nvfp4", "official"],
                    help="synth: which checkpoints to write (both by default; the official twin only feeds notebooks)")
    ap.add_argument("--no-inspect", action="store_true",
                    help="synth: write the checkpoints only (no inspect / plan runs: ~30 s of a device call)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="load: the embedded NVFP4 model over --gpus CPU devices (no CUDA, no timing claims)")
    ap.add_argument("--steps", type=int, default=256, help="decode steps (load / soak)")
    ap.add_argument("--free-gb", type=float, default=V4_PRO_WORST_FREE_GB)
    ap.add_argument("--only", nargs="+", default=["01", "02", "03", "04", "05", "06", "07"])
    ap.add_argument("--out", default="benchmarks/results/full_scale")
    args = ap.parse_args(argv)
    if args.cpu_smoke and args.stage != "load":
        ap.error("--cpu-smoke runs the load stage only")
    t0 = time.perf_counter()
    res = {"synth": stage_synth, "load": stage_load, "notebooks": stage_notebooks, "soak": stage_soak}[args.stage](args)
    res.update({"stage": args.stage, "argv": sys.argv[1:], "stage_s": time.perf_counter() - t0,
                "device": "cpu" if args.cpu_smoke else torch.cuda.get_device_name(), "torch": torch.__version__})
    write_json(Path(args.out), result_name(args), res)


def result_name(args, notebook: str | None = None) -> str:
    """``h200_full_scale_<stage>[_<notebooks>][_<N>gpu].json`` (``cpu_`` for the smoke run)."""
    suffix = "" if args.stage != "notebooks" else "_" + (notebook or "-".join(args.only))
    suffix += f"_{args.gpus}gpu" if args.gpus > 1 else ""
    return f"{'cpu' if args.cpu_smoke else 'h200'}_full_scale_{args.stage}{suffix}.json"


if __name__ == "__main__":
    main()
