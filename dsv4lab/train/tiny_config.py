"""The embedded model's architecture: every DSV4 mechanism live on prompts of ~100 tokens."""
from __future__ import annotations

from ..config import DSV4Config, config_from_dict


def tiny_dsv4_config(vocab_size: int) -> DSV4Config:
    return config_from_dict({
        "model_type": "deepseek_v4",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "head_dim": 128,
        "qk_rope_head_dim": 32,
        "q_lora_rank": 128,
        "o_groups": 4,
        "o_lora_rank": 64,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "n_shared_experts": 1,
        "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        # sliding, then CSA/HCA alternating as in the full model; 2 hash-routed layers first
        "layer_types": ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                        "heavily_compressed_attention", "compressed_sparse_attention",
                        "heavily_compressed_attention"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"],
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "sliding_window": 32,
        "index_n_heads": 8,
        "index_head_dim": 32,
        "index_topk": 8,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "max_position_embeddings": 4096,
        "bos_token_id": 0,
        "eos_token_id": 1,
    })
