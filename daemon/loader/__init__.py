"""The staging loader: `hotswap loader` (server) and the version store; its client and the descriptor it
exports are in `daemon.handoff`, its reads run on the byte pipeline (`daemon.bytepipe`)."""
