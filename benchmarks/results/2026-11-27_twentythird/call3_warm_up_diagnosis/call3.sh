source benchmarks/device_common.sh
timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/attention/test_triton_attention.py -k "warm_up and dtype0" 2>&1 | grep -v "^  " | tail -30 | cut -c1-3000 | tee "$OUT/tests.txt"
ROUNDS=1 verify_rounds "4" --quantization int4
