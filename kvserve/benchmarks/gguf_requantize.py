"""Write a copy of a GGUF file with its 4-bit linear weights (Q4_0 / Q4_1) requantized to
another block type (default Q8_0) or to one of llama.cpp's K-quant mixes (Q4_K_M, Q5_K_M),
every other tensor and all metadata as they are: real Q8_0 and Q4_K_M models to measure from
the embedded SmolLM2, which ships only as Q4_1.

    python -m kvserve.benchmarks.gguf_requantize OUT.gguf [--model IN.gguf] [--type Q8_0|Q4_K_M|...]
"""

from __future__ import annotations

import argparse
import re

import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from kvserve.benchmarks.k_quants import K_QUANT_TYPES, SUPER_BLOCK, quantize_k
from kvserve.model_executor.default_model import default_model_path

REQUANTIZED = (T.Q4_0, T.Q4_1)
# llama.cpp's mixes (llama_tensor_get_type): the base type, and Q6_K for the v and down
# projections of the layers use_more_bits picks.
MIXES = {"Q4_K_M": T.Q4_K, "Q5_K_M": T.Q5_K}
# What llama.cpp writes instead of a K-quant for rows that are no multiple of 256.
_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def _use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits: the first and last eighth, and every
    third in between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def mix_type(mix: str, name: str, columns: int, layers: int) -> T:
    """The block type llama.cpp's `mix` gives the linear weight `name` with rows of `columns`."""
    qtype = MIXES[mix]
    match = _LAYER_TENSOR.fullmatch(name)
    if match and match.group(2) in ("attn_v", "ffn_down") and _use_more_bits(int(match.group(1)), layers):
        qtype = T.Q6_K
    return _FALLBACK[qtype] if columns % SUPER_BLOCK else qtype


def requantize(source: str, out: str, target: T | str) -> None:
    """Copy `source` to `out` with its Q4_0 / Q4_1 tensors requantized to `target`: a block
    type, or the name of a mix (MIXES)."""
    reader = gguf.GGUFReader(source)
    layers = 1 + max((int(m.group(1)) for t in reader.tensors if (m := _LAYER_TENSOR.fullmatch(t.name))), default=0)
    architecture = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(out, architecture)
    for field in reader.fields.values():  # as gguf's own gguf_new_metadata.py copies them
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        data, qtype = tensor.data, tensor.tensor_type
        if qtype in REQUANTIZED:
            weight = dequantize(data, qtype)
            qtype = mix_type(target, tensor.name, weight.shape[-1], layers) if isinstance(target, str) else target
            data = quantize_k(weight, qtype) if qtype in K_QUANT_TYPES else quantize(weight, qtype)
        writer.add_tensor(tensor.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="Path of the GGUF file to write.")
    parser.add_argument("--model", default=None, help="GGUF file to read (default: the embedded SmolLM2).")
    parser.add_argument("--type", default="Q8_0",
                        help=f"Block type the 4-bit tensors become (Q8_0, Q5_0, Q4_K, Q6_K, ...) or a mix: "
                             f"{', '.join(MIXES)}.")
    args = parser.parse_args()
    target = args.type if args.type in MIXES else T[args.type]
    requantize(args.model or default_model_path(), args.out, target)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
