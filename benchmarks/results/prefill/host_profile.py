"""Host (Python) time of one V4-Pro-shaped prefill, by function (cProfile), and wall vs device."""
import sys, time, cProfile, pstats, io
sys.path.insert(0, '.')
import torch
from benchmarks.full_model import build, stack_experts
from dsv4lab.checkpoint.synth import preset_config
from dsv4lab.loading import install_kernels_for_load

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 4
T = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
cfg = preset_config('v4-pro', layers=layers, experts=8)
dev = torch.device('cuda', 0)
model = build(cfg, 'nvfp4', [dev] * layers, 0)
install_kernels_for_load(model, 'auto', [dev] * layers)
stack_experts(model)
state = model.new_state(1, T + 64)
ids = torch.randint(0, cfg.vocab_size, (1, T), device=dev)

def prefill():
    state.set_pos(0)
    return model.prefill(ids, state, chunk=T, last_only=True)

for _ in range(2): prefill()
torch.cuda.synchronize(); t0 = time.perf_counter(); prefill(); torch.cuda.synchronize(); wall = time.perf_counter() - t0
pr = cProfile.Profile()
torch.cuda.synchronize(); t0 = time.perf_counter()
pr.enable(); prefill(); pr.disable()
torch.cuda.synchronize(); wall_p = time.perf_counter() - t0
print(f'layers {layers}: wall {wall*1e3:.1f} ms; under cProfile {wall_p*1e3:.1f} ms')
s = io.StringIO(); st = pstats.Stats(pr, stream=s); st.sort_stats('tottime').print_stats(35); print(s.getvalue()[-9000:])
s = io.StringIO(); st = pstats.Stats(pr, stream=s); st.sort_stats('cumulative').print_stats(45); print(s.getvalue()[-9000:])
