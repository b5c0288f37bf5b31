"""Generation engine: a scheduler thread that advances every active sequence one token per step.

Each step takes the weight store's lock, so an update (which takes the same lock for its
write) always falls between steps. Every sequence keeps its own KV cache; after the weights
change the caches are dropped and each kept sequence is re-prefilled (prompt + the tokens it
already produced) under the new weights on its next step.

Sequences are stepped one forward each rather than padded into one batch: a sequence's greedy
output then never depends on what else is running, which is what the rollout's probe and the
tests compare. `max_batch` bounds how many are active at once; the rest wait in the queue.

Pause semantics: `pause()` returns once the scheduler is parked between forwards; requests that
arrive meanwhile queue and run after `resume()`. `pause(wait=True)` first stops admitting
queued requests and waits (bounded) for the active ones to finish. A step that sees a pause
asked stops before its next sequence's forward (those wait one step), and the forward in flight
is abandoned at its next decoder layer (`Preempted`, raised by a pre-hook on each layer, on the
scheduler thread only): a pause waits for one layer, not for a whole forward (issue 41: on an
H100 the pause call waited ~30 ms median for an 8B forward). The abandoned sequence gets no token
and re-prefills after resume, as every kept sequence does after new weights: its KV cache was
written by some layers only, so it is dropped.
`asked_at` / `parked_at` / `resumed_at` (time.monotonic) mark the last pause: asked (no sequence
is stepped after it but the one in its forward), parked, and let go; asked -> resumed is the
worker's pause window.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from daemon.worker.lora import Adapters, LoadedAdapter
from daemon.worker.model import LoadedModel
from daemon.worker.store import WeightStore

log = logging.getLogger("hotswap.worker.engine")


class Preempted(Exception):
    """Raised at a decoder layer's entry on the scheduler thread when a pause is waiting."""


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: the module list as long as its config's num_hidden_layers
    (empty when there is none: a pause then waits for the whole forward, as before)."""
    n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if not isinstance(n, int) or n <= 0:
        return []
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) == n:
            return list(m)
    return []


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # OpenAI semantics, over the generated tokens
    frequency_penalty: float = 0.0

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)


_ids = itertools.count(1)


@dataclass(eq=False, slots=True)
class Sequence:
    prompt: list[int]
    params: SamplingParams
    on_token: Callable[[Sequence, int], object] | None = None  # return values are ignored
    on_done: Callable[[Sequence], object] | None = None
    id: int = field(default_factory=lambda: next(_ids))
    generated: list[int] = field(default_factory=list)
    cache: Any = None  # transformers cache; None -> (re-)prefill on the next step
    generator: torch.Generator | None = None
    counts: torch.Tensor | None = None  # generated-token counts, only when a penalty is set
    finish_reason: str | None = None  # "length", "stop", "cancelled", "error"
    error: str | None = None
    versions: list[str] = field(default_factory=list)  # weight versions that produced its tokens
    prefills: int = 0
    cancelled: bool = False
    created: float = field(default_factory=time.monotonic)
    adapter: LoadedAdapter | None = None  # the LoRA adapter version it runs with, taken at admission (lora.py)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Engine:
    def __init__(
        self, loaded: LoadedModel, store: WeightStore, *, max_batch: int = 8, step_delay_s: float = 0.0
    ) -> None:
        self.loaded = loaded
        self.store = store
        self.max_batch = max(1, max_batch)
        self.step_delay_s = step_delay_s
        self._cond = threading.Condition()
        self._queue: deque[Sequence] = deque()
        self._active: list[Sequence] = []
        self._paused = False
        self._admitting = True
        self._in_step = False
        self._stopped = False
        self.asked_at = 0.0  # time.monotonic() when the last pause was asked
        self.parked_at = 0.0  # ... when it parked the scheduler
        self.resumed_at = 0.0  # ... and when it was let go again
        self.steps_cut = 0  # steps that stopped early for a pause
        self.forwards_preempted = 0  # forwards abandoned at a layer for a pause (their sequence re-prefills)
        self._preempt = False  # a pause waits: the scheduler's forward in flight stops at its next layer
        self._thread = threading.Thread(target=self._run, name="hotswap-scheduler", daemon=True)
        self.steps = 0
        self.wakeups_paused = 0  # the parked loop woke (e.g. a request arrived) and stayed parked
        self.adapters = Adapters(loaded.model)  # LoRA adapters served by `model` name, applied per sequence
        store.invalidators.append(self.invalidate_caches)
        for layer in decoder_layers(loaded.model):
            layer.register_forward_pre_hook(self._preempt_at_layer)

    def _preempt_at_layer(self, module: torch.nn.Module, args: Any) -> None:
        # the scheduler's thread only: a probe run under the store lock right after must never stop
        if self._preempt and threading.current_thread() is self._thread:
            raise Preempted

    # -- control -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def submit(self, seq: Sequence) -> None:
        with self._cond:
            self._queue.append(seq)
            self._cond.notify_all()

    def cancel(self, seq: Sequence) -> None:
        """The client went away: a queued sequence leaves the queue now, an active one is
        finished at the start of the next step (never in the middle of one)."""
        with self._cond:
            seq.cancelled = True
            try:
                self._queue.remove(seq)
            except ValueError:
                return  # active (or done): the step loop finishes it
            self._cond.notify_all()
        self._finish(seq, "cancelled")

    @property
    def in_flight(self) -> int:
        with self._cond:
            return len(self._queue) + len(self._active)

    @property
    def active(self) -> int:
        with self._cond:
            return len(self._active)

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self, *, wait: bool = False, timeout_s: float = 30.0) -> bool:
        """Park the scheduler between steps. wait=True: first let the active sequences finish
        (no new ones admitted) for up to timeout_s. Returns False if that wait timed out
        (the scheduler is parked anyway, keeping the unfinished sequences)."""
        finished = True
        asked = time.monotonic()
        with self._cond:
            if not self._paused:
                self.asked_at = asked
            if wait:
                self._admitting = False
                deadline = time.monotonic() + timeout_s
                while self._active and not self._paused:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        finished = False
                        break
                    self._cond.wait(left)
            self._paused = True
            self._admitting = True
            self._preempt = self._in_step  # the forward in flight stops at its next layer
            while self._in_step:
                self._cond.wait()
            self._preempt = False
            self.parked_at = time.monotonic()
        return finished

    def resume(self) -> None:
        with self._cond:
            if self._paused:
                self.resumed_at = time.monotonic()
            self._paused = False
            self._admitting = True
            self._cond.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is queued or active; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._active:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def invalidate_caches(self) -> None:
        """Drop every KV cache computed with the old weights (caller holds the store lock)."""
        with self._cond:
            for seq in self._active:
                seq.cache = None

    def fail_all(self, reason: str) -> None:
        """Finish every queued and active sequence with an error (weights not servable)."""
        with self._cond:
            victims = list(self._active) + list(self._queue)
            self._active.clear()
            self._queue.clear()
            self._cond.notify_all()
        for seq in victims:
            self._finish(seq, "error", reason)

    # -- the loop ------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (self._paused or not (self._active or self._queue)
                                             or (not self._active and not self._admitting)):
                    self._cond.wait()
                    self.wakeups_paused += self._paused  # woken (a request came, ...) and kept parked
                if self._stopped:
                    return
                while self._admitting and self._queue and len(self._active) < self.max_batch:
                    self._active.append(self._queue.popleft())
                batch = list(self._active)
                self._in_step = True
                self._preempt = False
            try:
                self._step(batch)
            finally:
                with self._cond:
                    self._in_step = False
                    self._preempt = False
                    self._active = [s for s in self._active if not s.done]
                    self._cond.notify_all()
            if self.step_delay_s:
                time.sleep(self.step_delay_s)

    def _step(self, batch: list[Sequence]) -> None:
        with self.store.lock:
            if self.store.unhealthy:
                for seq in batch:
                    self._finish(seq, "error", f"worker unhealthy: {self.store.unhealthy}")
                return
            version = self.store.current.version
            with torch.inference_mode():
                for i, seq in enumerate(batch):
                    if i and self._paused:  # a pause is waiting: the rest of the batch waits one step
                        self.steps_cut += 1
                        break
                    if seq.cancelled:
                        self._finish(seq, "cancelled")
                        continue
                    try:
                        with self.adapters.applied(seq.adapter):
                            token = self._next_token(seq)
                    except Preempted:  # a pause is waiting: no token; its cache is partly written
                        seq.cache = None
                        self.forwards_preempted += 1
                        self.steps_cut += 1
                        break
                    except Exception as exc:  # one bad sequence must not stop the others
                        log.exception("generation failed for sequence %s", seq.id)
                        self._finish(seq, "error", f"{type(exc).__name__}: {exc}")
                        continue
                    seq.generated.append(token)
                    if seq.counts is not None:
                        seq.counts[token] += 1
                    if not seq.versions or seq.versions[-1] != version:
                        seq.versions.append(version)
                    if seq.on_token is not None:
                        seq.on_token(seq, token)
                    if not seq.params.ignore_eos and token in self.loaded.eos_token_ids:
                        self._finish(seq, "stop")
                    elif len(seq.generated) >= seq.params.max_tokens:
                        self._finish(seq, "length")
            self.steps += 1

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if seq.done:
            return
        seq.finish_reason = reason
        seq.error = error
        seq.cache = None
        if seq.on_done is not None:
            try:
                seq.on_done(seq)
            except Exception:
                log.exception("completion callback failed for sequence %s", seq.id)

    def _next_token(self, seq: Sequence) -> int:
        m = self.loaded
        if seq.cache is None:
            from transformers import DynamicCache

            ids = seq.prompt + seq.generated
            seq.cache = DynamicCache(config=m.config)
            seq.prefills += 1
        else:
            ids = seq.generated[-1:]
        x = torch.tensor([ids], dtype=torch.long, device=m.device)
        out = m.model(input_ids=x, use_cache=True, logits_to_keep=1, **{m.cache_kwarg: seq.cache})
        logits = out.logits[0, -1].float()
        return sample(logits, seq)


def sample(logits: torch.Tensor, seq: Sequence) -> int:
    p = seq.params
    if p.penalised:
        if seq.counts is None:
            seq.counts = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
            for t in seq.generated:
                seq.counts[t] += 1
        logits = logits - p.frequency_penalty * seq.counts - p.presence_penalty * (seq.counts > 0).to(logits.dtype)
    if p.temperature <= 0:
        return int(torch.argmax(logits).item())
    if seq.generator is None:
        seq.generator = torch.Generator(device=logits.device)
        seq.generator.manual_seed(p.seed if p.seed is not None else int(time.time_ns() % (2**63)))
    probs = torch.softmax(logits / p.temperature, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < p.top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=seq.generator).item())


def probe(engine: Engine, max_tokens: int = 4, adapter: LoadedAdapter | None = None) -> dict[str, Any]:
    """One short greedy generation outside the scheduler (under the store lock), for post-update
    checks: works while the scheduler is parked. Reports the version and whether logits were finite.
    With `adapter`, the generation runs with that LoRA adapter applied (and reports its version)."""
    m = engine.loaded
    bos = m.bos_token_id if isinstance(m.bos_token_id, int) else 1
    prompt = [t % m.vocab_size for t in (bos, 3, 5, 7, 11)]
    seq = Sequence(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    finite = True
    with engine.store.lock, torch.inference_mode(), engine.adapters.applied(adapter):
        if engine.store.unhealthy:
            raise RuntimeError(f"worker unhealthy: {engine.store.unhealthy}")
        version = engine.store.current.version
        for _ in range(max_tokens):
            from transformers import DynamicCache

            ids = seq.prompt + seq.generated if seq.cache is None else seq.generated[-1:]
            if seq.cache is None:
                seq.cache = DynamicCache(config=m.config)
            x = torch.tensor([ids], dtype=torch.long, device=m.device)
            out = m.model(input_ids=x, use_cache=True, logits_to_keep=1, **{m.cache_kwarg: seq.cache})
            logits = out.logits[0, -1].float()
            finite = finite and bool(torch.isfinite(logits).all().item())
            seq.generated.append(int(torch.argmax(logits).item()))
    out = {"weight_version": version, "prompt_token_ids": prompt, "token_ids": seq.generated, "finite": finite}
    if adapter is not None:
        out.update(adapter=adapter.name, adapter_version=adapter.version)
    return out
