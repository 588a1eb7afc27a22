"""Write a copy of a GGUF file with its 4-bit linear weights (Q4_0 / Q4_1) requantized to
another block type (default Q8_0), every other tensor and all metadata as they are: a real
Q8_0 model to measure from the embedded SmolLM2, which ships only as Q4_1.

    python -m kvserve.benchmarks.gguf_requantize OUT.gguf [--model IN.gguf] [--type Q8_0]
"""

from __future__ import annotations

import argparse

import gguf
from gguf.quants import dequantize, quantize

from kvserve.model_executor.default_model import default_model_path

REQUANTIZED = (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1)


def requantize(source: str, out: str, target: gguf.GGMLQuantizationType) -> None:
    """Copy `source` to `out` with its Q4_0 / Q4_1 tensors requantized to `target`."""
    reader = gguf.GGUFReader(source)
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
            data, qtype = quantize(dequantize(data, qtype), target), target
        writer.add_tensor(tensor.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="Path of the GGUF file to write.")
    parser.add_argument("--model", default=None, help="GGUF file to read (default: the embedded SmolLM2).")
    parser.add_argument("--type", default="Q8_0", help="Block type the 4-bit tensors become.")
    args = parser.parse_args()
    requantize(args.model or default_model_path(), args.out, gguf.GGMLQuantizationType[args.type])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
