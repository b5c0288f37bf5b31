"""Daemon-side clients for workers: the reference worker, SGLang and vLLM."""
