"""Eager decode steps of the full-depth V4-Pro-shaped model (8 experts, one GPU) for a sampling
profiler to watch: ``py-spy record -r 1000 --format raw -o stacks.txt -- python3 THIS [ROOT] [SECONDS]``.
Sampling (unlike cProfile) does not slow each Python call, so the shares are the real ones."""
import sys, time
import depth_util
depth_util.use_root(sys.argv)
seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 15.0
import torch

model, state, step_ids = depth_util.full_depth(4096)
print("MARK decode start", flush=True)
n, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < seconds and n < 3000:
    model.decode_step(step_ids, state)
    n += 1
torch.cuda.synchronize()
print(f"eager {(time.perf_counter() - t0) / n * 1e3:.1f} ms/token over {n} tokens", flush=True)
