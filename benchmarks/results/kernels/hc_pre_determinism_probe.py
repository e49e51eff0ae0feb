import json, torch
from dsv4lab.kernels.mhc_fused import hc_pre
from dsv4lab.checkpoint.synth import preset_config
cfg = preset_config("v4-pro")
g = torch.Generator(device="cuda").manual_seed(0)
K = cfg.hc_mult * cfg.hidden_size
mix = (2 + cfg.hc_mult) * cfg.hc_mult
x = torch.randn(1, 4096, cfg.hc_mult, cfg.hidden_size, device="cuda", generator=g).bfloat16()
fn = torch.randn(mix, K, device="cuda", generator=g) * 0.02
base = torch.randn(mix, device="cuda", generator=g); scale = torch.rand(3, device="cuda", generator=g) + 0.5
res = {}
for dot in (False, True):
    first = hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6, dot=dot)
    diff = [0, 0, 0, 0]
    for _ in range(6):
        again = hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6, dot=dot)
        for i, (a, b) in enumerate(zip(again, first)):
            diff[i] += int((a != b).sum())
    res[f"dot={dot}"] = dict(zip(("pre", "post", "comb", "collapsed"), diff))
print("PROBE" + json.dumps(res))
