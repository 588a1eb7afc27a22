"""Triton kernels of the paged-attention backend: kv_cache_write, paged_attention."""
