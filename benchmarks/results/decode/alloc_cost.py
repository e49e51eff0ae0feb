"""Host cost of the tensor objects an eager decode step makes (CUDA): torch.empty and friends in a
fresh process, then with ~55 GB held in 12,030 blocks (as a loaded model does), and a view / reshape.
Usage (device): python3 benchmarks/results/decode/alloc_cost.py"""
import time, torch
dev = torch.device("cuda")
x = torch.randn(1, 1, 7168, device=dev, dtype=torch.bfloat16)
def bench(name, f, n=20000):
    for _ in range(200): f()
    t = time.perf_counter()
    for _ in range(n): f()
    print(f"{name:40s} {(time.perf_counter() - t) / n * 1e6:6.2f} us", flush=True)
def suite(tag):
    bench(f"{tag} empty((1,7168), device=, dtype=)", lambda: torch.empty((1, 7168), device=dev, dtype=torch.bfloat16))
    bench(f"{tag} empty(device=x.device)", lambda: torch.empty((1, 7168), device=x.device, dtype=torch.bfloat16))
    bench(f"{tag} x.new_empty((1,7168))", lambda: x.new_empty((1, 7168)))
    bench(f"{tag} empty_like(x)", lambda: torch.empty_like(x))
    bench(f"{tag} empty 8 MB", lambda: torch.empty((1 << 22,), device=dev, dtype=torch.bfloat16))
    bench(f"{tag} x.reshape(-1, 7168)", lambda: x.reshape(-1, 7168))
    bench(f"{tag} x.view(-1, 7168)", lambda: x.view(-1, 7168))
    bench(f"{tag} x[0]", lambda: x[0])
    bench(f"{tag} split 3", lambda: x.view(-1).split((16, 16, 7136)))
    bench(f"{tag} x.data_ptr()", lambda: x.data_ptr())
    bench(f"{tag} x.device", lambda: x.device)
    bench(f"{tag} torch.cuda.current_device()", lambda: torch.cuda.current_device())
suite("fresh")
held = [torch.empty(int(s), dtype=torch.uint8, device=dev) for s in torch.randint(1 << 12, 1 << 22, (12000,))]
held += [torch.empty(1 << 30, dtype=torch.uint8, device=dev) for _ in range(30)]
print(f"held {sum(h.numel() for h in held) / 1e9:.1f} GB in {len(held)} blocks", flush=True)
suite("held")
