"""cProfile of eager decode steps of the full-depth V4-Pro-shaped model (8 experts, one GPU), to see
where the host time of ``model.decode_step`` goes at depth (what the one-layer ``eager_layer.py``
cannot show). Usage (device): python3 benchmarks/results/decode/full_eager_profile.py [ROOT]"""
import cProfile, io, pstats, sys, time
root = sys.argv[1] if len(sys.argv) > 1 else "."
sys.path.insert(0, root); sys.path.insert(0, root + "/benchmarks")
import torch
import full_model as fm
from dsv4lab.checkpoint.synth import preset_config
from dsv4lab.kernels.install import install_kernels  # noqa: F401

cfg = preset_config("v4-pro", experts=8)
dev = torch.device("cuda", 0)
p, devices = fm.plan_placement(cfg, "nvfp4", 1, 600, "141GB", fm.DEFAULT_RESERVE, [dev])
model = fm.build(cfg, "nvfp4", devices, 0)
fm.install_kernels_for_load(model, "auto", devices)
fm.stack_experts(model)
state = model.new_state(1, 600)
ids = torch.randint(0, cfg.vocab_size, (1, 256), device=dev)
model.prefill(ids, state, chunk=256, last_only=True)
step_ids = torch.zeros(1, 1, dtype=torch.long, device=dev)
for _ in range(3):
    model.decode_step(step_ids, state)
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
