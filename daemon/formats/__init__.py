"""On-disk formats: safetensors headers, Hugging Face checkpoint layout, bounded small-file reads,
and the rules for the names a checkpoint brings (`names.py`: version labels, relative paths)."""
