"""Weight transports: disk (in-place loader), ipc (CUDA IPC / shared memory), broadcast."""
