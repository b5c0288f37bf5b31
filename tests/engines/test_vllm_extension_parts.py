"""The parts of vLLM's ipc path that need no vLLM (issue 39): the extension imports nothing vLLM's venv
lacks, its table check names the first difference, the daemon's judge of the extension's answers,
and the per-tensor digests of verified files. The path itself runs against a real vLLM in
tests/engines/test_vllm_ipc.py."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from daemon.bytepipe.expect import REFERENCE_ALGS
from daemon.engines.base import UpdateRefused, WorkerError
from daemon.engines.vllm_api import EXTENSION_RPC_METHODS
from daemon.engines.vllm_extension import HotswapWorkerExtension, table_problem
from daemon.engines.vllm_ipc import EXTENSION_CLS, PROTOCOL, has_extension, judge, tensor_digests
from daemon.handoff.descriptor import TensorSpec
from daemon.hashing import HASH_ALGORITHMS
from daemon.tinymodel import make_tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]
# what hotswap's own venv has and vLLM's need not (vLLM's venv gets hotswap with --no-deps)
NOT_IN_VLLM_VENV = ("crc32c", "blake3", "structlog", "sqlalchemy", "alembic", "fastapi", "prometheus_client",
                    "cryptography", "boto3", "rich", "psycopg", "safetensors", "httpx")  # fmt: skip


def test_the_extension_imports_only_the_standard_library_torch_and_light_hotswap_modules() -> None:
    code = ("import sys, json; import daemon.engines.vllm_extension as m; m.HotswapWorkerExtension; "
            "print(json.dumps(sorted({n.split('.')[0] for n in sys.modules})))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout))
    assert not loaded & set(NOT_IN_VLLM_VENV), sorted(loaded & set(NOT_IN_VLLM_VENV))


def test_the_class_and_its_methods_are_what_the_client_calls() -> None:
    module, _, cls = EXTENSION_CLS.rpartition(".")
    assert f"{HotswapWorkerExtension.__module__}.{HotswapWorkerExtension.__name__}" == EXTENSION_CLS
    methods = {m for m in dir(HotswapWorkerExtension) if not m.startswith("_")}
    assert methods == set(EXTENSION_RPC_METHODS)  # vLLM refuses an extension attribute its worker has
    import inspect

    for name, kwargs in EXTENSION_RPC_METHODS.items():
        params = list(inspect.signature(getattr(HotswapWorkerExtension, name)).parameters)[1:]
        assert params == list(kwargs), (name, params)


def test_reference_order_starts_with_the_strong_hashes() -> None:
    assert (*HASH_ALGORITHMS, "crc32c") == REFERENCE_ALGS


def spec(name: str, dtype: str = "BF16", shape: tuple[int, ...] = (4, 8)) -> TensorSpec:
    return TensorSpec(name, dtype, shape, 2 * shape[0] * shape[1] if dtype == "BF16" else 4 * shape[0] * shape[1])


def test_table_problem_names_the_first_difference() -> None:
    model = {"a": spec("a"), "b": spec("b")}
    assert table_problem(dict(model), model) is None
    assert "tensor 'c' is not a tensor of the served model" in str(table_problem({**model, "c": spec("c")}, model))
    assert "tensor 'b' of the served model is missing" in str(table_problem({"a": spec("a")}, model))
    assert "dtype F32, the served model's is BF16" in str(table_problem({**model, "b": spec("b", "F32")}, model))
    assert "shape [8, 4], the served model's is [4, 8]" in str(table_problem({**model, "a": spec("a", shape=(8, 4))}, model))


def test_has_extension_needs_every_rank() -> None:
    ok = {"extension": "hotswap", "protocol": PROTOCOL}
    assert has_extension([ok, ok]) and not has_extension([]) and not has_extension([ok, None])
    assert not has_extension([{**ok, "protocol": PROTOCOL + 1}])


def test_judge_refused_partial_mismatch_and_match() -> None:
    want = {"a": "11", "b": "22"}
    fed = {"version": "v1", "checksums": dict(want), "tensors": 2, "bytes": 64, "ms": 3.0}
    with pytest.raises(UpdateRefused, match="refused v1: bad table"):
        judge("w", "v1", [{"refused": "bad table"}, {"refused": "bad table"}], want)
    with pytest.raises(WorkerError, match="1 of 2 ranks refused"):
        judge("w", "v1", [{"refused": "x"}, fed], want)
    with pytest.raises(WorkerError, match="rank 1 fed v1's 'b' with bytes that differ"):
        judge("w", "v1", [fed, {**fed, "checksums": {"a": "11", "b": "23"}}], want)
    with pytest.raises(WorkerError, match="rank 0 answered"):
        judge("w", "v1", [{**fed, "version": "v0"}], want)
    assert judge("w", "v1", [fed, fed], want)["fed_checksums"] == "match"


def test_tensor_digests_are_the_sha256_of_each_tensors_bytes(tmp_path: Path) -> None:
    d = make_tiny_checkpoint(tmp_path / "c", seed=3, shards=2, dtype="bfloat16")
    sums = tensor_digests(str(d))
    tensors = {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert sums.keys() == tensors.keys()
    for name, t in tensors.items():
        raw = t.contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes()
        assert sums[name] == hashlib.sha256(raw).hexdigest(), name
