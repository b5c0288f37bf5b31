"""How a staged version passes between processes: the loader's socket protocol and its client,
the IPC descriptor (the one JSON document a worker opens), sealed shared-memory segments and
CUDA IPC buffers. The loader (`daemon.loader`) writes them, the ipc transport (worker side) and
the ipc verify stager read them; neither imports the other.
"""
