"""hotswap: keep LLM serving workers on the newest good checkpoint without restarting them."""

__version__ = "0.1.0"
