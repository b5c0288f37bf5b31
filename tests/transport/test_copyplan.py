"""Coalesced ipc copies (daemon/transport/copyplan.py) equal one copy per tensor, bit for bit."""

from __future__ import annotations

import random

import pytest
import torch

from daemon.handoff.descriptor import layout_tensors
from daemon.transport.base import TORCH_TO_ST
from daemon.transport.copyplan import plan_copies, run_copies
from daemon.worker.flat import pack_flat

pytestmark = pytest.mark.quick

# odd sizes on purpose: 30-byte and 6-byte tensors leave alignment gaps between neighbours
SHAPES = {"embed": (64, 16), "a.norm": (15,), "a.q": (16, 16), "a.bias": (3,), "b.norm": (15,), "b.q": (16, 16),
          "b.odd": (3, 5), "head": (64, 16)}  # fmt: skip
DTYPES = {"a.bias": torch.float32, "b.odd": torch.float16}


def make_params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(DTYPES.get(n, torch.bfloat16)) for n, s in SHAPES.items()}


def staged(values: dict[str, torch.Tensor], order: list[str]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A loader-like flat payload of `values` laid out in `order`, and views of it by name."""
    entries = [(n, TORCH_TO_ST[str(values[n].dtype).removeprefix("torch.")], tuple(values[n].shape)) for n in order]
    slots, size = layout_tensors(entries)
    payload = torch.full((size + 256,), 0xAB, dtype=torch.uint8)  # gaps hold a pattern no tensor has
    views = {}
    for s in slots:
        v = payload[s.offset : s.offset + s.nbytes].view(values[s.name].dtype).view(values[s.name].shape)
        v.copy_(values[s.name])
        views[s.name] = v
    return payload, views


def per_tensor(params: dict[str, torch.Tensor], views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {n: p.clone() for n, p in params.items()}
    for n, t in out.items():
        t.copy_(views[n])
    return out


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("shuffle", [False, True])
def test_coalesced_copy_equals_per_tensor_copy_bit_for_bit(shuffle: bool) -> None:
    order = list(SHAPES)
    params = make_params(1)
    flat = pack_flat(params, order)
    src_order = list(order)
    if shuffle:  # another sharding: the loader's order differs from the worker's
        random.Random(7).shuffle(src_order)
    payload, views = staged(make_params(2), src_order)
    want = per_tensor(params, views)
    pairs = [(params[n], views[n]) for n in order]
    plan = plan_copies(pairs, flat, payload)
    run_copies(plan, flat, payload)
    for n in order:
        assert bits(params[n]) == bits(want[n]), n
    if not shuffle:
        assert plan.copies == 1 and plan.runs[0].tensors == len(order)  # the whole version in one copy
    else:
        assert 1 < plan.copies <= len(order)
        assert sum(r.tensors for r in plan.runs) + len(plan.singles) == len(order)


def test_without_a_flat_destination_every_tensor_is_its_own_copy() -> None:
    params = make_params(1)  # separate allocations
    payload, views = staged(make_params(3), list(SHAPES))
    want = per_tensor(params, views)
    plan = plan_copies([(params[n], views[n]) for n in SHAPES], None, payload)
    assert plan.runs == [] and len(plan.singles) == len(SHAPES)
    run_copies(plan, None, payload)
    assert all(bits(params[n]) == bits(want[n]) for n in SHAPES)


def test_a_tensor_between_two_run_members_is_never_overwritten_by_the_gap_copy() -> None:
    # worker layout a, b, c; in the source a and c keep their distance but b sits elsewhere, so
    # one copy a..c would carry stale source bytes over b: b must break the run
    params = {"a": torch.zeros(128, dtype=torch.uint8), "b": torch.zeros(128, dtype=torch.uint8),
              "c": torch.zeros(128, dtype=torch.uint8)}  # fmt: skip
    flat = pack_flat(params, ["a", "b", "c"])
    payload = torch.arange(1024, dtype=torch.int32).to(torch.uint8)
    src = {"a": payload[0:128], "c": payload[512:640], "b": payload[768:896]}
    # a at dst 0 / src 0, b at dst 256 / src 768, c at dst 512 / src 512: a and c share the displacement
    plan = plan_copies([(params[n], src[n]) for n in "abc"], flat, payload)
    run_copies(plan, flat, payload)
    for n in "abc":
        assert torch.equal(params[n], src[n]), n
    assert plan.copies == 3


def test_packing_keeps_values_and_makes_views_of_one_buffer() -> None:
    params = make_params(5)
    before = {n: bits(t) for n, t in params.items()}
    flat = pack_flat(params, ["head", "embed"])
    for n, t in params.items():
        assert bits(t) == before[n]
        assert t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert t.data_ptr() % 256 == flat.data_ptr() % 256  # each at a 256-byte boundary of the buffer
    assert params["head"].data_ptr() == flat.data_ptr()  # `order` first
