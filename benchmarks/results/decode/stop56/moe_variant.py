"""``benchmarks/full_model.py`` with the MoE decode's schedule / tiles set first (one process per
setting): ``python3 moe_variant.py VARIANT [full_model args]``. VARIANT ``default`` (NVFP4: two
launches, 64-row down tiles) or ``fused128`` (NVFP4: one fused launch, 128-row down tiles: faster
on the H100's MoE microbench, stop 47, but the rows' sums in another order than 64-row tiles)."""
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))
from dsv4lab.kernels import moe_decode_tma as m  # noqa: E402

variant = sys.argv.pop(1)
if variant == "fused128":
    m.SCHEDULE = "fused"
    m.FUSED_TILES = {**m.FUSED_TILES, False: ((64, 4, 4), (128, 3, 4))}
elif variant != "default":
    sys.exit(f"moe_variant.py: VARIANT must be default or fused128, got {variant!r}")
print("moe variant", variant, m.SCHEDULE, m.FUSED_TILES, flush=True)
sys.argv[0] = str(ROOT / "benchmarks/full_model.py")
runpy.run_path(sys.argv[0], run_name="__main__")
