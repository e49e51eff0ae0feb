"""Kernels for quantised DSV4 inference, each beside the PyTorch reference it must match.

| component | kernel (module.function) | PyTorch reference (module.function) | test file |
|---|---|---|---|
| QLinear nvfp4, M <= 16 on sm_90+ | `linear_nvfp4_tma.launch_gemv_tma` via `linear_nvfp4.nvfp4_matmul` | `linear_nvfp4.nvfp4_matmul_ref` (= `NVFP4Weight.dequantize` + `F.linear`) | tests/test_kernels.py |
| QLinear nvfp4, other M / GPUs | `linear_nvfp4.nvfp4_matmul` (pointer GEMV, tiled GEMM) | `linear_nvfp4.nvfp4_matmul_ref` | tests/test_kernels.py |
| QLinear mxfp4 / fp8_block | `linear_official.verified_official_matmul` | `w.dequantize` + `F.linear` | tests/test_kernels.py |
| QLinear fp8_block, M = 1 on sm_90+ (also wq_a + wkv paired) | `linear_fp8_tma.fp8_gemv` / `fp8_pair_gemv` via `official_matmul` / `verified_official_pair` | `w.dequantize` + `F.linear` | tests/test_fp8_gemv.py |
| QLinear w4a4 activation quant | `act_quant_nvfp4.nvfp4_act_quant` | `dsv4lab.quant.activations.fake_quant_nvfp4` | tests/test_kernels.py |
| routed Experts decode (nvfp4, mxfp4) | `moe_decode.moe_decode_triton` (-> `moe_decode_tma.moe_decode_tma` on sm_90+) | `moe_decode_ref.moe_decode_ref` | tests/test_kernels.py, tests/test_kernels_model.py |
| routed Experts decode (plain: BF16 originals, fp32) | `moe_decode_plain.moe_decode_plain_triton` | `moe_decode_ref.moe_decode_plain_ref` | tests/test_moe_plain.py |
| QLinear nvfp4 / mxfp4 (bf16 x; nvfp4 also fp16), 64 <= M < 512 on sm_90+ with Gluon | `linear_gemm_wgmma.launch_wgmma_gemm` (async wgmma; via `linear_gemm.prefill_gemm`) | `w.dequantize` + `F.linear` | tests/test_gemm_wgmma.py, tests/test_gemm.py |
| QLinear fp8_block (and the FP4 formats without Gluon), 64 <= M < 512 on sm_90+ | `linear_gemm.launch_gemm` (via `nvfp4_matmul`, `official_matmul`) | `w.dequantize` + `F.linear` | tests/test_gemm.py |
| QLinear nvfp4 / mxfp4 / fp8_block, M >= 512 | `dequant_gemm.dense_gemm` (dequantise + cuBLAS, via `linear_gemm.prefill_gemm`) | `w.dequantize` + `F.linear` (bitwise) | tests/test_dequant_gemm.py |
| routed Experts prefill, >= 512 rows an expert | `moe_prefill.moe_prefill_dense` | `moe_prefill_ref.moe_prefill_ref` | tests/test_dequant_gemm.py |
| routed Experts prefill (nvfp4, mxfp4) | `moe_prefill.moe_prefill_triton` | `moe_prefill_ref.moe_prefill_ref` | tests/test_gemm.py |
| routed Experts prefill (nvfp4, mxfp4) on sm_90+ with Gluon | `moe_prefill_wgmma.grouped_wgmma` (async wgmma; via `moe_prefill.moe_prefill_triton`) | `moe_prefill_ref.moe_prefill_ref` | tests/test_moe_prefill_wgmma.py |
| Compressor pool | `compressor_pool_cute.compressor_pool_cute` | `compressor_pool_cute.compressor_pool_ref` | tests/test_cute_kernels.py |
| Compressor decode step | `compressor_decode.compressor_decode_triton` | `dsv4lab.model.compressor.Compressor.decode_window` | tests/test_compressor_decode_kernel.py |
| QLinear grouped (wo_a), nvfp4 | `linear_nvfp4.nvfp4_grouped_matmul` (-> `linear_nvfp4_tma.launch_gemv_tma(groups=G)`; from 512 tokens one dequantisation + bmm) | `dsv4lab.model.linear.grouped_linear` | tests/test_kernels.py |
| QLinear grouped (wo_a), fp8_block, one token | `linear_fp8_tma.fp8_grouped_gemv` (one launch) | `dsv4lab.model.linear.grouped_linear` | tests/test_fp8_gemv.py |
| QLinear grouped (wo_a), mxfp4 / fp8_block otherwise | `QLinear.kernel` once per row block (`QuantWeight.row_block` views) | `dsv4lab.model.linear.grouped_linear` | tests/test_kernels_model.py |
| SharedExpert on its own (SwiGLU; w1 + w3 paired) | `moe_prefill.swiglu` via `dispatch.swiglu`; `dispatch.quant_linear_pair` | `dsv4lab.model.swiglu.clamped_swiglu`; each linear | tests/test_kernels_model.py, tests/test_fp8_gemv.py |
| Compressor entries' norm + RoPE (prefill, `rope_kernel`) | `norm_rope.launch_norm_rope` | `Compressor.pool`'s norm + `apply_rope` | tests/model/test_compressor.py |
| Attention q_norm / norm + RoPE / inverse RoPE (decode glue) | `norm_rope.launch_norm_rope` | `dsv4lab.model.norms.rms_norm`, `norm_rope_ref.norm_rope_ref` | tests/test_glue_kernels.py |
| Router scores + top-k / hash + weights | `router_topk.route_triton` | `dsv4lab.model.moe.route` | tests/test_glue_kernels.py |
| Attention prefill (bounded) | `attention_bounded.bounded_attention_triton` | `dsv4lab.model.bounded_attention.bounded_attention` | tests/test_attention_kernel.py |
| HyperConnection mixes + collapse / expansion, HyperHead (prefill from 1024 bf16 tokens: the dense tier, cuBLAS products of fn's parts + one finish) | `mhc_fused.hc_pre` / `hc_post` / `hc_head_pre` | `dsv4lab.model.mhc.mix_weights` + `collapse` / `HyperConnection.expand` / `head_weights` + `collapse` | tests/test_mhc_kernel.py |
| QLinear unquantised bf16 / fp16, <= 4 rows, <= 384 outputs (`plain_kernel`) | `linear_plain.plain_gemv` | `F.linear` | tests/test_linear_plain.py |
| Attention decode (window ring + entries / top-k, sink) | `attention_decode.decode_attention_triton` | `dsv4lab.model.decode_attention.decode_attention` | tests/test_attention_decode_kernel.py |
| Indexer decode scores | `indexer_decode.index_scores_decode_triton` | `dsv4lab.model.indexer.index_scores_decode` | tests/test_attention_decode_kernel.py |
| Indexer prefill scores | `indexer_prefill.index_scores_prefill_triton` | `dsv4lab.model.indexer.index_scores_prefill` | tests/test_indexer_prefill_kernel.py |


Entry points (``dispatch``: kernel where it runs, reference elsewhere): ``quant_linear``,
``plain_linear``, ``grouped_quant_linear``, ``act_quant_nvfp4``, ``moe_decode``, ``moe_prefill``, ``compressor_pool``,
``compressor_decode``, ``prefill_attention``, ``decode_attention``, ``index_scores_decode``, ``index_scores_prefill``, ``mhc_pre``, ``mhc_post``, ``mhc_head_pre``,
``rms_norm``, ``norm_rope``, ``route``. Installing them on a model:
``install.install_kernels(model, pattern, enable)``. Shared Triton helpers: ``host`` (host side of
the launches), ``pdl``, ``rounding``, ``split_k``, ``weight_decode``, ``attention_tiles``,
``activation_pairs``; the launch-device guard and availability check: ``device``. Importing ``dsv4lab.kernels`` imports
neither triton nor cutlass (the kernel modules do, and are imported inside the calls).
See docs/kernels.md for layouts, tolerances and measured numbers.
"""
from __future__ import annotations

from .device import have_triton_cuda
from .dispatch import (act_quant_nvfp4, compressor_decode, compressor_pool, decode_attention, plain_linear, grouped_quant_linear,
                       index_scores_decode, index_scores_prefill,
                       mhc_head_pre, mhc_post, mhc_pre, moe_decode, moe_prefill, norm_rope, nvfp4_linear,
                       prefill_attention, quant_linear, rms_norm, route)
from .install import install_kernels, kernel_state, kernel_targets, restore_kernels

__all__ = ["have_triton_cuda", "quant_linear", "nvfp4_linear", "plain_linear", "grouped_quant_linear", "moe_decode", "moe_prefill",
           "act_quant_nvfp4", "compressor_pool", "compressor_decode", "prefill_attention", "decode_attention", "index_scores_decode", "index_scores_prefill",
           "mhc_pre", "mhc_post", "mhc_head_pre", "rms_norm", "norm_rope", "route",
           "install_kernels", "kernel_state", "kernel_targets", "restore_kernels"]
