"""Export a trained tiny model to ``data/tiny-dsv4``: BF16 transformers layout + NVFP4 ModelOpt.

    python -m dsv4lab.train.export --state RUN_DIR --out data/tiny-dsv4

Writes ``config.json`` (transformers field names) and ``model.safetensors`` in the layout
transformers' ``save_pretrained`` writes (mHC params, sinks, compressor position biases and
router biases in fp32, everything else bf16), and ``nvfp4/`` with every linear in NVFP4
(ModelOpt layout, ``hf_quant_config.json``) plus the config and tokenizer.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil

import torch
from safetensors.torch import load_file

from ..checkpoint.synth import TOKENIZER_FILES
from ..checkpoint.writer import save_checkpoint
from .tiny_config import tiny_dsv4_config

FP32_KEEP = ("_hc.fn", "_hc.base", "_hc.scale", "hc_head.fn", "hc_head.base", "hc_head.scale", "attn.sink",
             ".ape", "router.bias")


def load_run_state(run_dir: str) -> dict[str, torch.Tensor]:
    files = sorted(glob.glob(os.path.join(run_dir, "state-*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{run_dir}: no state-*.safetensors (train_tiny output)")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(f))
    return sd


def export(state: dict[str, torch.Tensor], out: str, vocab_size: int | None = None, tokenizer_dir: str | None = None) -> dict:
    cfg = tiny_dsv4_config(vocab_size or state["embed.weight"].shape[0])
    sd = {k: (v.float() if k.endswith(FP32_KEEP) else v.to(torch.bfloat16)) if v.is_floating_point() else v
          for k, v in state.items()}
    os.makedirs(out, exist_ok=True)
    bf16 = save_checkpoint(out, cfg, sd, layout="transformers", progress=False)
    nv_dir = os.path.join(out, "nvfp4")
    nv = save_checkpoint(nv_dir, cfg, sd, layout="official", nvfp4=["*"], progress=False)
    tok_src = tokenizer_dir or out
    for fn in TOKENIZER_FILES:
        src = os.path.join(tok_src, fn)
        if os.path.exists(src):
            for dst_dir in ({out, nv_dir} - {tok_src}) | ({nv_dir} if tok_src == out else set()):
                shutil.copy(src, os.path.join(dst_dir, fn))
    return {"bf16": bf16, "nvfp4": nv}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state", required=True, help="train_tiny output dir (state-*.safetensors)")
    ap.add_argument("--out", default="data/tiny-dsv4")
    ap.add_argument("--tokenizer-dir", default=None, help="where tokenizer.json is (default: --out)")
    args = ap.parse_args(argv)
    summary = export(load_run_state(args.state), args.out, tokenizer_dir=args.tokenizer_dir)
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk in ("files", "bytes", "tensors")} for k, v in summary.items()},
                     default=str, indent=1))


if __name__ == "__main__":
    main()
