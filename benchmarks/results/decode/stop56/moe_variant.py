"""``benchmarks/full_model.py`` with the MoE decode's schedule / tiles set first (one process per
setting): ``python3 moe_variant.py VARIANT [full_model args]``. VARIANT ``default`` (the code's
defaults) or ``two64`` / ``fused128`` (NVFP4: two launches with 64-row down tiles, stop 56's default;
one fused launch with 128-row down tiles, the default since stop 57)."""
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))
from dsv4lab.kernels import moe_decode_tma as m  # noqa: E402

variant = sys.argv.pop(1)
if variant == "fused128":
    m.SCHEDULE = "fused"
    m.FUSED_UP_TILES, m.DOWN_TILES = {**m.FUSED_UP_TILES, False: (64, 4, 4)}, {**m.DOWN_TILES, False: (128, 3, 4)}
elif variant == "two64":
    m.SCHEDULE = "two"
    m.DOWN_TILES = {**m.DOWN_TILES, False: (64, 3, 4)}
elif variant != "default":
    sys.exit(f"moe_variant.py: VARIANT must be default, two64 or fused128, got {variant!r}")
print("moe variant", variant, m.SCHEDULE or m.DEFAULT_SCHEDULE, m.FUSED_UP_TILES, m.DOWN_TILES, flush=True)
sys.argv[0] = str(ROOT / "benchmarks/full_model.py")
runpy.run_path(sys.argv[0], run_name="__main__")
