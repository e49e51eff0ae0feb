"""Full-depth eager decode host time of the V4-Pro-shaped model (8 experts, one GPU) for the code
under ROOT: build, 256-token prefill, 3 warm-up steps, then ROUNDS rounds of STEPS eager tokens;
prints one JSON line (ms/token per round: wall after a synchronise; min and median).
Run it for two trees in alternation on one machine to compare them (host time drifts between runs):
    python3 benchmarks/results/decode/full_eager_ab.py ROOT [ROUNDS] [STEPS]"""
import json, statistics, sys, time
root = sys.argv[1] if len(sys.argv) > 1 else "."
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 20
sys.path.insert(0, root); sys.path.insert(0, root + "/benchmarks")
import torch
import full_model as fm
from dsv4lab.checkpoint.synth import preset_config

cfg = preset_config("v4-pro", experts=8)
dev = torch.device("cuda", 0)
p, devices = fm.plan_placement(cfg, "nvfp4", 1, 600, "141GB", fm.DEFAULT_RESERVE, [dev])
model = fm.build(cfg, "nvfp4", devices, 0)
fm.install_kernels_for_load(model, "auto", devices)
fm.stack_experts(model)
state = model.new_state(1, 256 + 8 + rounds * steps)
ids = torch.randint(0, cfg.vocab_size, (1, 256), device=dev)
model.prefill(ids, state, chunk=256, last_only=True)
step_ids = torch.zeros(1, 1, dtype=torch.long, device=dev)
for _ in range(3):
    logits = model.decode_step(step_ids, state)
torch.cuda.synchronize()
ms = []
for _ in range(rounds):
    t = time.perf_counter()
    for _ in range(steps):
        logits = model.decode_step(step_ids, state)
    torch.cuda.synchronize()
    ms.append((time.perf_counter() - t) / steps * 1e3)
print(json.dumps({"root": root, "ms_per_token": [round(m, 2) for m in ms], "min": round(min(ms), 2),
                  "median": round(statistics.median(ms), 2), "logits_finite": bool(torch.isfinite(logits).all())}))
