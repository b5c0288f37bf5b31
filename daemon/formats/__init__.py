"""On-disk formats: safetensors headers, Hugging Face checkpoint layout, bounded small-file reads,
and the rules for the names a checkpoint brings (`names.py`: version labels, relative paths)."""

from typing import TYPE_CHECKING

from daemon import public_face

if TYPE_CHECKING:
    from daemon.formats.adapter import (
        ADAPTER_WEIGHTS,
        AdapterConfig,
        AdapterLayoutError,
        LoraPair,
        identity,
        is_adapter,
        lora_pairs,
        name_problem,
        read_adapter_config,
    )
    from daemon.formats.checkpoint import (
        INDEX_NAME,
        MANIFEST_NAME,
        LayoutError,
        TensorLocation,
        read_config,
        read_index,
        tensor_table,
        weight_files,
    )
    from daemon.formats.names import ManifestError, check_relative_path, check_version_label, version_problem
    from daemon.formats.safetensors import (
        DTYPE_SIZES,
        HEADER_CAP_BYTES,
        HeaderError,
        SafetensorsHeader,
        parse_header_bytes,
        read_header,
    )
    from daemon.formats.smallfile import (
        INDEX_CAP_BYTES,
        MANIFEST_CAP_BYTES,
        SmallFileError,
        SmallFileMissing,
        read_json_object,
        read_small_file,
    )

__all__ = [
    "ADAPTER_WEIGHTS", "AdapterConfig", "AdapterLayoutError", "DTYPE_SIZES", "HEADER_CAP_BYTES",
    "HeaderError", "INDEX_CAP_BYTES", "INDEX_NAME", "LayoutError", "LoraPair", "MANIFEST_CAP_BYTES",
    "MANIFEST_NAME", "ManifestError", "SafetensorsHeader", "SmallFileError", "SmallFileMissing",
    "TensorLocation", "check_relative_path", "check_version_label", "identity", "is_adapter",
    "lora_pairs", "name_problem", "parse_header_bytes", "read_adapter_config", "read_config",
    "read_header", "read_index", "read_json_object", "read_small_file", "tensor_table", "version_problem",
    "weight_files"
]

__getattr__ = public_face(__name__)
