"""Host (Python) time of one V4-Pro-shaped prefill, by function (cProfile), and wall vs device.

    python3 benchmarks/results/prefill/host_profile.py [layers] [tokens]
"""
import cProfile
import io
import pstats
import sys
import time

sys.path.insert(0, '.')
import torch  # noqa: E402
from benchmarks.full_model import build, stack_experts  # noqa: E402
from dsv4lab.checkpoint.synth import preset_config  # noqa: E402
from dsv4lab.loading import install_kernels_for_load  # noqa: E402


def prefill_fn(layers: int, T: int):
    """(cfg, a zero-arg prefill of T random tokens) on a V4-Pro-shaped model of ``layers`` layers,
    8 experts, kernels installed, one chunk."""
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

    return cfg, prefill


if __name__ == "__main__":
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    T = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    _, prefill = prefill_fn(layers, T)
    for _ in range(2):
        prefill()
    torch.cuda.synchronize(); t0 = time.perf_counter(); prefill(); torch.cuda.synchronize(); wall = time.perf_counter() - t0
    pr = cProfile.Profile()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    pr.enable(); prefill(); pr.disable()
    torch.cuda.synchronize(); wall_p = time.perf_counter() - t0
    print(f'layers {layers}: wall {wall*1e3:.1f} ms; under cProfile {wall_p*1e3:.1f} ms')
    for order in ('tottime', 'cumulative'):
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats(order).print_stats(40); print(s.getvalue()[-9000:])
