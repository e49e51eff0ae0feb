"""Can the dense MoE prefill drop its host sync? ``torch._grouped_mm`` (expert offsets on the device)
against the per-expert ``torch.mm`` loop that needs the counts on the host, V4-Pro expert shapes
(H 7168, I 3072), 8 experts, top-6 of T tokens: time of each (CUDA events, median of 10) and whether
the outputs are bitwise the loop's.

    python3 benchmarks/results/prefill/grouped_mm_probe.py [T ...]
"""
import statistics
import sys

import torch

H, I, E, K = 7168, 3072, 8, 6


def timed(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main():
    dev = torch.device("cuda")
    g = torch.Generator(dev).manual_seed(0)
    for T in [int(t) for t in sys.argv[1:]] or [4096, 2304, 1024]:
        R = T * K
        ids = torch.randint(0, E, (R,), device=dev, generator=g)
        counts = torch.bincount(ids, minlength=E)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        c = counts.tolist()
        for N, Kd, name in ((I, H, "up (x @ w1^T)"), (H, I, "down (h @ w2^T)")):
            x = torch.randn(R, Kd, device=dev, dtype=torch.bfloat16, generator=g)
            w = torch.randn(E, N, Kd, device=dev, dtype=torch.bfloat16, generator=g) * 0.02

            def loop():
                y = torch.empty(R, N, device=dev, dtype=torch.bfloat16)
                r0 = 0
                for e in range(E):
                    torch.mm(x[r0:r0 + c[e]], w[e].t(), out=y[r0:r0 + c[e]])
                    r0 += c[e]
                return y

            def grouped():
                return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)

            try:
                yl, yg = loop(), grouped()
                same = bool(torch.equal(yl, yg))
                diff = (yl.float() - yg.float()).abs().max().item()
                tl_, tg = timed(loop), timed(grouped)
                flops = 2 * R * N * Kd
                print(f"T={T} {name}: loop {tl_:.3f} ms ({flops / tl_ / 1e9:.0f} TFLOP/s), grouped {tg:.3f} ms "
                      f"({flops / tg / 1e9:.0f} TFLOP/s), bitwise equal {same}, max abs diff {diff:.3g}", flush=True)
            except Exception as exc:  # noqa: BLE001  (the probe reports what fails)
                print(f"T={T} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)


if __name__ == "__main__":
    main()
