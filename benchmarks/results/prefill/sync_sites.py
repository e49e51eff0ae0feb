"""Every host sync in one V4-Pro-shaped prefill (few layers), with the Python lines that caused it,
and wall vs device time.

    python3 benchmarks/results/prefill/sync_sites.py [layers] [tokens]
"""
import collections
import sys
import time
import traceback
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from host_profile import prefill_fn  # this folder: the model and its prefill

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 4
T = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
_, prefill = prefill_fn(layers, T)
prefill(); torch.cuda.synchronize()
sites = collections.Counter()


def show(message, category, filename, lineno, file=None, line=None):
    st = [f for f in traceback.extract_stack() if 'dsv4lab' in f.filename]
    sites[' <- '.join(f'{f.filename.split("dsv4lab/")[-1]}:{f.lineno}' for f in st[-3:][::-1])] += 1


warnings.showwarning = show
warnings.simplefilter('always')
torch.cuda.set_sync_debug_mode(1)
prefill(); torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode(0)
print('syncs per prefill of', layers, 'layers:')
for k, v in sites.most_common():
    print(f'{v:5d}  {k}')
for _ in range(2):
    prefill()
torch.cuda.synchronize(); t0 = time.perf_counter(); prefill(); torch.cuda.synchronize(); wall = time.perf_counter() - t0
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    prefill(); torch.cuda.synchronize()
dev_us = sum(e.device_time for e in prof.events() if e.device_type.name == 'CUDA')
print(f'wall {wall*1e3:.1f} ms, device {dev_us/1e3:.1f} ms, gap {wall*1e3-dev_us/1e3:.1f} ms over {layers} layers')
