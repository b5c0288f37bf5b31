"""The worker's model + engine + update path in-process (runs on cuda too when present)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from daemon.formats.checkpoint import LayoutError, weight_files
from daemon.tinymodel import make_tiny_checkpoint
from daemon.transport.base import UpdateRequest, WorkerTransport, check_table
from daemon.transport.disk import DiskTransport
from daemon.worker import updates
from daemon.worker.engine import Engine, SamplingParams, Sequence, decoder_layers
from daemon.worker.model import LoadedModel, build_model
from daemon.worker.store import VersionRecord, WeightStore

pytestmark = pytest.mark.quick

# reported as skipped where there is no GPU, never silently left out of the collection
DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))]
PROMPT = [1, 9, 33, 77, 120]


def load(directory: Path, device: str, version: str) -> tuple[LoadedModel, WeightStore]:
    loaded = build_model(directory, torch.device(device))
    tr = DiskTransport(directory)
    check_table(tr.table(), loaded.params)
    tr.write_into(loaded.params)
    rec = VersionRecord(version, None, "disk", str(directory), request={"path": str(directory)})
    return loaded, WeightStore(loaded.params, torch.device(device), rec)


def reference_greedy(directory: Path, prompt: list[int], n: int) -> list[int]:
    """transformers' own loader, no KV cache: the full context recomputed for every token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt):]


def run(engine: Engine, prompt: list[int], n: int, *, on_token=None) -> Sequence:  # type: ignore[no-untyped-def]
    done = threading.Event()
    seq = Sequence(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                   on_token=on_token, on_done=lambda s: done.set())
    engine.submit(seq)
    assert done.wait(30), "generation did not finish"
    return seq


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    r = tmp_path_factory.mktemp("engine")
    return {"a": make_tiny_checkpoint(r / "a", seed=4), "b": make_tiny_checkpoint(r / "b", seed=5, shards=3)}


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def engine_a(ckpts: dict[str, Path], device: str) -> Iterator[Engine]:
    loaded, store = load(ckpts["a"], device, "a")
    eng = Engine(loaded, store, max_batch=4)
    eng.start()
    yield eng
    eng.stop()


def test_greedy_output_equals_transformers_reference(engine_a: Engine, ckpts: dict[str, Path]) -> None:
    assert run(engine_a, PROMPT, 10).generated == reference_greedy(ckpts["a"], PROMPT, 10)


def test_concurrent_sequences_do_not_disturb_each_other(engine_a: Engine) -> None:
    alone = run(engine_a, PROMPT, 8).generated
    done = threading.Event()
    others = [Sequence([2 + i, 5, 7], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)) for i in range(5)]
    for s in others:
        engine_a.submit(s)
    mine = Sequence(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), on_done=lambda s: done.set())
    engine_a.submit(mine)
    assert done.wait(30)
    assert mine.generated == alone


def test_update_keeps_storage_and_reprefills_kept_sequences(engine_a: Engine, ckpts: dict[str, Path]) -> None:
    import time

    store = engine_a.store
    ptrs = store.data_ptrs()
    engine_a.step_delay_s = 0.01
    finished = threading.Event()
    seq = Sequence(PROMPT, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                   on_done=lambda s: finished.set())
    engine_a.submit(seq)
    deadline = time.monotonic() + 30
    while len(seq.generated) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    engine_a.pause()  # parked between steps, the sequence kept with its KV cache
    k = len(seq.generated)
    assert 3 <= k < 20 and seq.cache is not None
    result = updates.apply_update(store, updates.parse_request({"version": "b", "path": str(ckpts["b"])}))
    assert result["version"] == "b" and store.current.version == "b"
    assert store.previous is not None and store.previous.version == "a"
    assert store.data_ptrs() == ptrs
    assert seq.cache is None  # invalidated
    engine_a.resume()
    assert finished.wait(30)
    assert seq.versions == ["a", "b"] and seq.prefills == 2
    assert seq.generated[k:] == reference_greedy(ckpts["b"], PROMPT + seq.generated[:k], 20 - k)
    # rollback reloads a from its path, into the same storage
    updates.rollback(store)
    assert store.current.version == "a" and store.data_ptrs() == ptrs
    assert run(engine_a, PROMPT, 6).generated == reference_greedy(ckpts["a"], PROMPT, 6)


def test_failed_write_restores_previous_weights(engine_a: Engine, ckpts: dict[str, Path], tmp_path: Path) -> None:
    import os
    import shutil

    store = engine_a.store
    before = run(engine_a, PROMPT, 6).generated
    bad = Path(shutil.copytree(ckpts["b"], tmp_path / "b-bad"))
    transport = updates.open_and_validate(updates.parse_request({"version": "x", "path": str(bad)}), store).transport
    shard = weight_files(bad)[-1]
    os.truncate(shard, shard.stat().st_size // 2)  # damaged after validation, before the write

    def once(request: UpdateRequest, st: WeightStore) -> WorkerTransport:
        return transport  # the already-validated transport over the now-damaged files

    with pytest.raises(updates.WriteFailed, match="short read") as info:
        updates.apply_update(store, updates.parse_request({"version": "x", "path": str(bad)}), open_transport=once)
    assert info.value.detail["restored"] is True
    assert store.current.version == "a" and store.unhealthy is None
    assert run(engine_a, PROMPT, 6).generated == before


def test_tied_embeddings_load_from_a_checkpoint_without_lm_head(tmp_path: Path) -> None:
    d = make_tiny_checkpoint(tmp_path / "tied", seed=6, config_overrides={"tie_word_embeddings": True})
    f = weight_files(d)[0]
    state = load_file(f)
    both = dict(state)
    del state["lm_head.weight"]
    save_file(state, str(f), metadata={"format": "pt"})
    loaded, _ = load(d, "cpu", "tied")
    assert "lm_head.weight" not in loaded.params
    assert loaded.model.lm_head.weight.data_ptr() == loaded.params["model.embed_tokens.weight"].data_ptr()
    assert torch.equal(loaded.model.lm_head.weight, state["model.embed_tokens.weight"])
    # the same checkpoint holding both tied names is refused with both names
    save_file(both, str(f), metadata={"format": "pt"})
    with pytest.raises(LayoutError, match="lm_head.weight"):
        build_model(d, torch.device("cpu"))


def test_cancel_frees_a_queued_sequence_at_once_and_an_active_one_at_the_next_step(engine_a: Engine) -> None:
    engine_a.pause()
    ended: list[str | None] = []
    queued = Sequence(PROMPT, SamplingParams(max_tokens=50, ignore_eos=True), on_done=lambda s: ended.append(s.finish_reason))
    engine_a.submit(queued)
    assert engine_a.in_flight == 1
    engine_a.cancel(queued)  # still queued: leaves the queue and is finished now, while paused
    assert ended == ["cancelled"] and engine_a.in_flight == 0
    engine_a.resume()
    started = threading.Event()
    active = Sequence(PROMPT, SamplingParams(max_tokens=10_000, ignore_eos=True),
                      on_token=lambda s, t: started.set(), on_done=lambda s: ended.append(s.finish_reason))
    engine_a.submit(active)
    assert started.wait(30)
    engine_a.cancel(active)
    assert engine_a.wait_idle(10) and ended[-1] == "cancelled" and len(active.generated) < 10_000


def test_penalties_apply_to_the_generated_tokens(engine_a: Engine) -> None:
    def gen(**penalty: float) -> list[int]:
        done = threading.Event()
        seq = Sequence(PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, **penalty),
                       on_done=lambda s: done.set())
        engine_a.submit(seq)
        assert done.wait(30)
        return seq.generated

    plain = gen()
    repeated = gen(frequency_penalty=2.0)
    assert repeated != plain
    # greedy with a strong frequency penalty repeats tokens less
    assert len(set(repeated)) >= len(set(plain))
    assert gen(presence_penalty=0.0, frequency_penalty=0.0) == plain


def test_pause_waits_for_one_forward_not_for_the_whole_step(engine_a: Engine) -> None:
    """A pause asked while a step runs parks the scheduler before the step's next sequence (issue
    41: the pause call waited for a whole step over every active sequence); the cut sequence takes
    its token after resume, and every sequence ends with all its tokens."""
    engine_a.pause()  # both sequences admitted into the same step once resumed
    errors: list[BaseException] = []
    pauser: list[threading.Thread] = []

    def on_first(seq: Sequence, token: int) -> None:  # runs on the scheduler thread, inside the step
        if pauser:
            return
        try:
            t = threading.Thread(target=engine_a.pause)
            t.start()
            pauser.append(t)  # after start: the test thread joins it as soon as it sees it
            while not engine_a.paused:  # positive signal: the pause is asked and waits for the step
                t.join(0.001)
        except BaseException as exc:  # re-raised in the test thread
            errors.append(exc)

    done = [threading.Event(), threading.Event()]
    first = Sequence(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True), on_token=on_first,
                     on_done=lambda s: done[0].set())
    second = Sequence([2, 5, 7], SamplingParams(max_tokens=5, ignore_eos=True), on_done=lambda s: done[1].set())
    engine_a.submit(first)
    engine_a.submit(second)
    cut = engine_a.steps_cut
    engine_a.resume()
    while not pauser:
        assert not done[0].is_set()
        threading.Event().wait(0.001)
    pauser[0].join(30)
    assert not pauser[0].is_alive() and not errors
    assert (len(first.generated), len(second.generated)) == (1, 0)  # the second waits for the next step
    assert engine_a.steps_cut == cut + 1 and engine_a.parked_at > 0
    engine_a.resume()
    assert done[0].wait(30) and done[1].wait(30)
    assert len(first.generated) == 5 and len(second.generated) == 5
    assert engine_a.resumed_at >= engine_a.parked_at


def test_a_pause_abandons_the_forward_in_flight_at_its_next_layer(engine_a: Engine) -> None:
    """A pause asked in the middle of a forward stops it at the next decoder layer (issue 41: the
    pause call waited for a whole 8B forward, ~30 ms): the sequence gets no token from it, drops
    its half-written KV cache, and after resume re-prefills and ends with the very tokens it
    would have produced without the pause."""
    expected = run(engine_a, PROMPT, 4).generated
    layers = decoder_layers(engine_a.loaded.model)
    assert len(layers) >= 2, "the tiny model needs two layers for this test"
    entered: list[int] = []  # layers the scheduler's forwards entered (after the engine's own hook)
    pauser: list[threading.Thread] = []

    def hold_first_layer(module: torch.nn.Module, args: object) -> None:
        if threading.current_thread() is not engine_a._thread:
            return
        entered.append(layers.index(module))
        if not pauser and module is layers[0]:
            t = threading.Thread(target=engine_a.pause)
            t.start()
            pauser.append(t)
            while not engine_a._preempt:  # the pause is asked and waits for this very forward
                t.join(0.001)

    handles = [layer.register_forward_pre_hook(hold_first_layer) for layer in layers]
    try:
        preempted = engine_a.forwards_preempted
        done = threading.Event()
        seq = Sequence(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True), on_done=lambda s: done.set())
        engine_a.submit(seq)
        while not pauser:
            assert not done.is_set()
            threading.Event().wait(0.001)
        pauser[0].join(30)
        assert not pauser[0].is_alive()
        assert entered == [0], entered  # layer 1 was never entered: the forward stopped there
        assert engine_a.forwards_preempted == preempted + 1
        assert seq.generated == [] and seq.cache is None and seq.prefills == 1
        engine_a.resume()
        assert done.wait(30), "the sequence did not finish after resume"
    finally:
        for h in handles:
            h.remove()
    assert seq.finish_reason == "length" and seq.generated == expected and seq.prefills == 2
