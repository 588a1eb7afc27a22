"""Held-out style prompts that the quantization tests decode with the real SmolLM2."""

PROMPTS = [
    "Hi!",
    "Name three rivers in Europe and say which countries they flow through.",
    "Write a haiku about autumn leaves.",
    "Explain why the sky is blue.",
    "def fibonacci(n):",
    "The capital of France is",
]

# Sentence starts that SmolLM2 continues at length (engine-level comparisons of whole outputs).
CONTINUATIONS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three primary colors:",
    "Once upon a time, in a small village,",
    "The best way to learn a language is",
]
