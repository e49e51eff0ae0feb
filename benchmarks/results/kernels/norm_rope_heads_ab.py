import json, torch
from triton.testing import do_bench
from dsv4lab.kernels.norm_rope import launch_norm_rope, NORM_PLAIN, NORM_NONE
T, H, D = 4096, 128, 512
x = torch.randn(T, H, D, device="cuda").bfloat16()
pos = torch.arange(T, device="cuda")
inv = 1.0 / (10000 ** (torch.arange(0, 64, 2, device="cuda").float() / 64))
res = {}
ref = launch_norm_rope(x, torch.bfloat16, norm=NORM_PLAIN, eps=1e-6, positions=pos, inv_freq=inv)
for hb in (2, 4, 8, 16, 32):
    y = launch_norm_rope(x, torch.bfloat16, norm=NORM_PLAIN, eps=1e-6, positions=pos, inv_freq=inv, heads_per_program=hb)
    us = do_bench(lambda: launch_norm_rope(x, torch.bfloat16, norm=NORM_PLAIN, eps=1e-6, positions=pos, inv_freq=inv, heads_per_program=hb)) * 1e3
    us_inv = do_bench(lambda: launch_norm_rope(x, torch.bfloat16, norm=NORM_NONE, positions=pos, inv_freq=inv, inverse=True, heads_per_program=hb)) * 1e3
    res[hb] = {"q_us": us, "inverse_us": us_inv, "equal": bool(torch.equal(y, ref)), "q_of_copy_GBps": 2 * x.numel() * 2 / us / 1e3}
b = torch.empty_like(x)
res["copy_us"] = do_bench(lambda: b.copy_(x)) * 1e3
print("NR" + json.dumps(res))
xi = x.clone()
res["inplace_inverse_us"] = do_bench(lambda: launch_norm_rope(xi, torch.bfloat16, norm=NORM_NONE, positions=pos, inv_freq=inv, inverse=True, inplace=True)) * 1e3
y1 = launch_norm_rope(x, torch.bfloat16, norm=NORM_NONE, positions=pos, inv_freq=inv, inverse=True)
x2 = x.clone(); y2 = launch_norm_rope(x2, torch.bfloat16, norm=NORM_NONE, positions=pos, inv_freq=inv, inverse=True, inplace=True)
res["inplace_equal"] = bool(torch.equal(y1, y2))
print("NR2" + json.dumps(res))
