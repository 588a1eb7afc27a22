"""Triton kernels of the paged-attention backend: paged_attention, kv_cache_write, and the
batch layout they read (batch.PagedBatch)."""
