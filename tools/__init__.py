"""Repository tools that are not part of the installed daemon (the docs site's generators)."""
