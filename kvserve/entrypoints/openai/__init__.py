"""OpenAI-compatible HTTP server (FastAPI); imported only by `kvserve serve`."""
