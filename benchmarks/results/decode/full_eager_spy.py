"""Eager decode steps of the full-depth V4-Pro-shaped model (8 experts, one GPU) for a sampling
profiler to watch: ``py-spy record -r 1000 --format raw -o stacks.txt -- python3 THIS [ROOT] [SECONDS]``.
Sampling (unlike cProfile) does not slow each Python call, so the shares are the real ones."""
import sys, time
root = sys.argv[1] if len(sys.argv) > 1 else "."
seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 15.0
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
state = model.new_state(1, 4096)
ids = torch.randint(0, cfg.vocab_size, (1, 256), device=dev)
model.prefill(ids, state, chunk=256, last_only=True)
step_ids = torch.zeros(1, 1, dtype=torch.long, device=dev)
for _ in range(3):
    model.decode_step(step_ids, state)
torch.cuda.synchronize()
print("MARK decode start", flush=True)
n, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < seconds and n < 3000:
    model.decode_step(step_ids, state)
    n += 1
torch.cuda.synchronize()
print(f"eager {(time.perf_counter() - t0) / n * 1e3:.1f} ms/token over {n} tokens", flush=True)
