"""The quantized linears' kernels: weight-only matmuls (weight_only/: int8, 4-bit and fp8
weights read in their stored form), the fp8 x fp8 matmul (fp8_w8a8) and per-token fp8
quantization of activations (fp8_activation), with their launch configurations; and the
form in which one kernel hands a quantized linear its input as fp8: Fp8Rows (fp8_rows). (An
RMSNorm left pending for the next linear is kvserve.ops.pending_norm's PendingNorm.)"""
