"""How a staged version passes between processes: the loader's socket protocol and its client,
the IPC descriptor (the one JSON document a worker opens), sealed shared-memory segments and
CUDA IPC buffers. The loader (`daemon.loader`) writes them, the ipc transport (worker side) and
the ipc verify stager read them; neither imports the other.
"""

from typing import TYPE_CHECKING

from daemon import public_face

if TYPE_CHECKING:
    from daemon.handoff.cuda import CudaIpcError, DeviceBuffer, ImportedBuffer, device_index, device_uuid
    from daemon.handoff.descriptor import (
        ALIGN,
        HOST_DEVICE,
        MAX_VERSION_CHARS,
        BufferRef,
        Descriptor,
        DescriptorError,
        IpcRefused,
        TensorSlot,
        TensorSpec,
        align_up,
        layout_tensors,
        parse_descriptor,
    )
    from daemon.handoff.loader_client import LoaderClient, LoaderError, LoaderUnavailable
    from daemon.handoff.loader_protocol import (
        MAX_REQUEST_BYTES,
        OPS,
        ProtocolError,
        decode,
        encode,
        read_line,
    )
    from daemon.handoff.shm import ShmError, ShmMapping, ShmSegment, segment_name, segment_owner
    from daemon.handoff.tie import tie_to_loader

__all__ = [
    "ALIGN", "BufferRef", "CudaIpcError", "Descriptor", "DescriptorError", "DeviceBuffer", "HOST_DEVICE",
    "ImportedBuffer", "IpcRefused", "LoaderClient", "LoaderError", "LoaderUnavailable",
    "MAX_REQUEST_BYTES", "MAX_VERSION_CHARS", "OPS", "ProtocolError", "ShmError", "ShmMapping",
    "ShmSegment", "TensorSlot", "TensorSpec", "align_up", "decode", "device_index", "device_uuid",
    "encode", "layout_tensors", "parse_descriptor", "read_line", "segment_name", "segment_owner",
    "tie_to_loader"
]

__getattr__ = public_face(__name__)
