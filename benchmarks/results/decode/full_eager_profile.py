"""cProfile of eager decode steps of the full-depth V4-Pro-shaped model (8 experts, one GPU), to see
where the host time of ``model.decode_step`` goes at depth (what the one-layer ``eager_layer.py``
cannot show). Usage (device): python3 benchmarks/results/decode/full_eager_profile.py [ROOT]"""
import cProfile, io, pstats, sys, time
import depth_util
depth_util.use_root(sys.argv)
import torch

model, state, step_ids = depth_util.full_depth(600)
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(10):
    model.decode_step(step_ids, state)
torch.cuda.synchronize()
print(f"eager {(time.perf_counter() - t) / 10 * 1e3:.1f} ms/token", flush=True)
prof = cProfile.Profile()
prof.enable()
for _ in range(4):
    model.decode_step(step_ids, state)
torch.cuda.synchronize()
prof.disable()
out = io.StringIO()
st = pstats.Stats(prof, stream=out)
st.sort_stats("tottime").print_stats(28)
st.sort_stats("cumtime").print_stats(28)
print(out.getvalue())
