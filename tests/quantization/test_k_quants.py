"""K-quant blocks written by kvserve.benchmarks.k_quants, read back by gguf's own dequantizer,
and llama.cpp's Q4_K_M / Q5_K_M type choices in the requantizing tool."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from kvserve.benchmarks.gguf_requantize import mix_type, requantize
from kvserve.benchmarks.k_quants import quantize_k
from kvserve.quantization.gguf import unpack_blocks
from tests.quantization.test_gguf_packed import write_tiny_llama


def _relative_rms(approx: np.ndarray, weight: np.ndarray) -> float:
    return float(np.sqrt(((approx - weight) ** 2).mean()) / weight.std())


# Each K type against gguf's own quantizer of the same bits per weight (32-wide blocks with a
# minimum, or for Q6_K a 5-bit one it must clearly beat).
@pytest.mark.parametrize("qtype,peer,factor", [(T.Q4_K, T.Q4_1, 1.05), (T.Q5_K, T.Q5_1, 1.05), (T.Q6_K, T.Q5_0, 0.5)])
def test_blocks_read_back_by_gguf_as_close_as_its_own_quantizer(qtype, peer, factor):
    weight = np.random.default_rng(3).normal(0, 0.05, (48, 768)).astype(np.float32)
    weight[1, :256] = 0.0  # an all-zero super-block stays zero
    weight[2, 256:512] = np.linspace(0.01, 0.3, 256)  # one sign only: the minimum is 0
    raw = quantize_k(weight, qtype)
    back = dequantize(raw, qtype)
    assert raw.dtype == np.uint8 and raw.shape == (48, 3 * {T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}[qtype])
    assert np.array_equal(back[1, :256], np.zeros(256))
    assert _relative_rms(back, weight) <= factor * _relative_rms(dequantize(quantize(weight, peer), peer), weight)
    assert np.allclose(back[2, 256:512], weight[2, 256:512], atol=0.3 / 15)
    assert torch.equal(unpack_blocks(raw, qtype, (48, 768), "w").dequantize(), torch.from_numpy(back))


def test_quantize_k_refuses_what_it_cannot_write():
    with pytest.raises(ValueError, match="with 576 columns"):
        quantize_k(np.zeros((2, 576), np.float32), T.Q4_K)
    with pytest.raises(ValueError, match="got Q8_0"):
        quantize_k(np.zeros((2, 256), np.float32), T.Q8_0)


def test_q4_k_m_gives_v_and_down_q6_k_in_llama_cpps_layers():
    """llama.cpp's use_more_bits over 30 layers: the first and last eighth, every third between."""
    more_bits = [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    for layer in range(30):
        expected = T.Q6_K if layer in more_bits else T.Q4_K
        assert mix_type("Q4_K_M", f"blk.{layer}.attn_v.weight", 1536, 30) == expected
        assert mix_type("Q4_K_M", f"blk.{layer}.ffn_down.weight", 1536, 30) == expected
        assert mix_type("Q4_K_M", f"blk.{layer}.attn_q.weight", 1536, 30) == T.Q4_K
        assert mix_type("Q5_K_M", f"blk.{layer}.ffn_up.weight", 1536, 30) == T.Q5_K
    # Rows that are no multiple of 256 (SmolLM2's 576) take llama.cpp's fallbacks.
    assert mix_type("Q4_K_M", "blk.0.attn_q.weight", 576, 30) == T.Q5_0
    assert mix_type("Q4_K_M", "blk.0.attn_v.weight", 576, 30) == T.Q8_0
    assert mix_type("Q5_K_M", "blk.3.attn_q.weight", 576, 30) == T.Q5_1


def test_requantized_file_has_the_mix_and_the_source_weights(tmp_path):
    source, out = str(tmp_path / "q4_0.gguf"), str(tmp_path / "q4_k_m.gguf")
    parts = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    write_tiny_llama(source, dict.fromkeys(parts, T.Q4_0))
    requantize(source, out, "Q4_K_M")
    before = {t.name: t for t in gguf.GGUFReader(source).tensors}
    after = {t.name: t for t in gguf.GGUFReader(out).tensors}
    assert set(before) == set(after)
    for name, tensor in after.items():
        if tensor.tensor_type == T.F32:
            assert np.array_equal(tensor.data, before[name].data), name
            continue
        # Two layers: layer 1 is the last eighth, so its v and down get Q6_K.
        more_bits = name in ("blk.1.attn_v.weight", "blk.1.ffn_down.weight")
        assert tensor.tensor_type == (T.Q6_K if more_bits else T.Q4_K), name
        weight = dequantize(before[name].data, T.Q4_0)
        assert _relative_rms(dequantize(tensor.data, tensor.tensor_type), weight) < 0.1, name
