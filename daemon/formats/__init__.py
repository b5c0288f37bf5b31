"""On-disk formats: safetensors headers and Hugging Face checkpoint layout."""
