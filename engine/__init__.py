"""MiniPaged: offline batch generation for Qwen3 around a paged KV cache."""
