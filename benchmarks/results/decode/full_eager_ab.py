"""Full-depth eager decode host time of the V4-Pro-shaped model (8 experts, one GPU) for the code
under ROOT: build, 256-token prefill, 3 warm-up steps, then ROUNDS rounds of STEPS eager tokens;
prints one JSON line (ms/token per round: wall after a synchronise; min and median).
Run it for two trees in alternation on one machine to compare them (host time drifts between runs):
    python3 benchmarks/results/decode/full_eager_ab.py ROOT [ROUNDS] [STEPS]"""
import json, statistics, sys, time
import depth_util
root = depth_util.use_root(sys.argv)
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 20
import torch

model, state, step_ids = depth_util.full_depth(256 + 8 + rounds * steps)
logits = None
ms = []
for _ in range(rounds):
    t = time.perf_counter()
    for _ in range(steps):
        logits = model.decode_step(step_ids, state)
    torch.cuda.synchronize()
    ms.append((time.perf_counter() - t) / steps * 1e3)
print(json.dumps({"root": root, "ms_per_token": [round(m, 2) for m in ms], "min": round(min(ms), 2),
                  "median": round(statistics.median(ms), 2), "logits_finite": bool(torch.isfinite(logits).all())}))
