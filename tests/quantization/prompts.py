"""Held-out style prompts that the quantization tests decode with the real SmolLM2."""

PROMPTS = [
    "Hi!",
    "Name three rivers in Europe and say which countries they flow through.",
    "Write a haiku about autumn leaves.",
    "Explain why the sky is blue.",
    "def fibonacci(n):",
    "The capital of France is",
]
