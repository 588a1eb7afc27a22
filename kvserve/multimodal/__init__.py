"""Images in prompts: loading them from URLs (media.py), preprocessing them with the
model's own image processor into placeholder tokens and pixel tensors (processing.py),
and the plain data a request carries of each (inputs.py)."""
