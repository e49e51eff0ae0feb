"""Every host sync in one V4-Pro-shaped prefill (few layers), with the Python line that caused it,
and the host-only time per layer (GPU kept busy by a long queue)."""
import sys, time, traceback, warnings, collections
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

prefill(); torch.cuda.synchronize()
sites = collections.Counter()
def show(message, category, filename, lineno, file=None, line=None):
    st = [f for f in traceback.extract_stack() if 'dsv4lab' in f.filename]
    key = ' <- '.join(f'{f.filename.split("dsv4lab/")[-1]}:{f.lineno}' for f in st[-3:][::-1])
    sites[key] += 1
warnings.showwarning = show
warnings.simplefilter('always')
torch.cuda.set_sync_debug_mode(1)
prefill(); torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode(0)
print('syncs per prefill of', layers, 'layers:')
for k, v in sites.most_common(): print(f'{v:5d}  {k}')
# wall vs device: time unprofiled
for _ in range(2): prefill()
torch.cuda.synchronize(); t0 = time.perf_counter(); prefill(); torch.cuda.synchronize(); wall = time.perf_counter() - t0
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    prefill(); torch.cuda.synchronize()
dev_us = sum(e.device_time for e in prof.events() if e.device_type.name == 'CUDA')
print(f'wall {wall*1e3:.1f} ms, device {dev_us/1e3:.1f} ms, gap {wall*1e3-dev_us/1e3:.1f} ms over {layers} layers')
# host-only time: queue a long sleep first so every launch is asynchronous... syncs break it; measure CPU time
torch.cuda.synchronize(); t0 = time.perf_counter(); torch.cuda._sleep(int(3e9)); prefill(); t1 = time.perf_counter(); torch.cuda.synchronize()
print(f'host time of one prefill behind a 2 s sleep (syncs wait): {(t1-t0)*1e3:.1f} ms')
