"""The staging loader: `hotswap loader` (server), `LoaderClient` (client), the version store."""
