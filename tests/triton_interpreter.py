"""Running Triton kernels under the interpreter in CI: a subprocess (TRITON_INTERPRET must
be set before triton is imported and must not leak into the other tests of this process)
with fixes for bugs of Triton 3.6's interpreter applied first."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def patch_interpreter() -> None:
    """Five bugs of Triton 3.6's interpreter, fixed here rather than in the kernels:
    it turns its (1,)-shaped scalars into loop bounds with int(), which numpy >= 2.4
    rejects (triton-lang/triton#9171); its tl.dot multiplies bf16 operands' raw uint16
    bits; it casts integers to bf16 by storing the integer as the raw bits; it truncates
    fp32 to bf16 (half of random values one ulp off); and it rounds fp32 to e4m3 and e5m2
    wrongly (ties away from zero, some values an exponent off). Upcasting bf16 operands to
    fp32 for the dot, integers to fp32 before bf16, and rounding to bf16 and float8 with
    torch's casts (to nearest even, as the GPU does) keeps exact values."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched_tensor(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    def to_fp32(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        return interpreter.TensorHandle(
            (handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32
        )

    create_dot = interpreter.InterpreterBuilder.create_dot

    def patched_dot(self, a, b, *args):
        return create_dot(self, to_fp32(a), to_fp32(b), *args)

    cast = interpreter.InterpreterBuilder.cast_impl

    def patched_cast(self, src, dst_type):
        if dst_type.scalar != tl.bfloat16 or src.dtype.scalar != tl.float32:
            return cast(self, src, dst_type)
        bits = torch.from_numpy(src.data).to(torch.bfloat16).view(torch.int16).numpy()
        return interpreter.TensorHandle(bits.view(np.uint16), tl.bfloat16)

    def patched_int_to_fp(self, src, dst_type):
        if dst_type.scalar != tl.bfloat16:
            return cast(self, src, dst_type)
        as_fp32 = interpreter.TensorHandle(src.data.astype(np.float32), tl.float32)
        return patched_cast(self, as_fp32, dst_type)

    fp_to_fp = interpreter.InterpreterBuilder.create_fp_to_fp

    float8 = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}

    def patched_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar not in float8 or src.dtype.scalar != tl.float32:
            return fp_to_fp(self, src, dst_type, rounding_mode)
        bits = torch.from_numpy(src.data).to(float8[dst_type.scalar]).view(torch.uint8).numpy()
        return interpreter.TensorHandle(bits, dst_type.scalar)

    interpreter._patch_lang_tensor = patched_tensor
    interpreter.InterpreterBuilder.cast_impl = patched_cast
    interpreter.InterpreterBuilder.create_fp_to_fp = patched_fp_to_fp
    interpreter.InterpreterBuilder.create_dot = patched_dot
    interpreter.InterpreterBuilder.create_si_to_fp = patched_int_to_fp
    interpreter.InterpreterBuilder.create_ui_to_fp = patched_int_to_fp


def run_interpreted(module: str, function: str, *args: object) -> str:
    """Call `module.function(*args)` (a dotted name from the repository root; args JSON
    values) in an interpreter subprocess; returns the last line it printed."""
    command = (f"import json, sys; import tests.triton_interpreter as i; i.patch_interpreter(); "
               f"import {module} as m; m.{function}(*json.loads(sys.argv[1]))")
    proc = subprocess.run(
        [sys.executable, "-c", command, json.dumps(args)], check=False, cwd=REPO_ROOT,
        env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return proc.stdout.strip().splitlines()[-1]


def slow_tests_selected(request: pytest.FixtureRequest) -> bool:
    """Whether this run selected a slow-marked test of the module asking: its interpreter
    subprocess then runs the slow cases too, else the default run's only."""
    return any(item.module is request.module and item.get_closest_marker("slow") for item in request.session.items)
