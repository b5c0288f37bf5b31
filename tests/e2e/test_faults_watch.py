"""The fault matrix's measure of an outage while /health said ok (bench/faults_watch.py), on
made-up samples: a worker's serving truth and /health samples with the times they were sent and
answered. No process is started: the figures are arithmetic over those times."""

from __future__ import annotations

from bench.faults_watch import Watch


def _watch(serving: list[tuple[float, bool]], health: list[tuple[float, float, bool]]) -> Watch:
    w = Watch(lambda: "http://unused", ["http://worker"], load=False)
    for t, up in serving:
        w.probers[0].up.set(t, up)
    for sent, answered, ok in health:
        w.health_sent.append(sent)
        w.health_seen.append((answered, ok, [] if ok else ["no_worker_serving"]))
    return w


def test_health_ok_on_both_sides_of_an_outage_counts_it() -> None:
    # the worker stops serving at 10.0 for a second; /health keeps answering ok throughout
    w = _watch([(0.0, True), (10.0, False), (11.0, True)],
               [(t / 10, t / 10 + 0.01, True) for t in range(0, 150)])  # fmt: skip
    f = w.figures(5.0, 14.0)
    assert abs(f["no_worker_s"] - 1.0) < 0.03 and abs(f["outage_while_ok_s"] - 1.0) < 0.03, f
    assert f["outage_while_ok_at"] and abs(f["outage_while_ok_at"][0][0] - 5.0) < 0.02, f


def test_a_sample_sent_before_the_outage_and_answered_after_it_vouches_for_neither_side() -> None:
    # the worker dies at 10.0; a sample sent at 9.98 answers ok at 10.01 (computed before the
    # death, say); every sample sent from 10.0 on says not ok
    health = [(t / 10, t / 10 + 0.01, True) for t in range(0, 100)]
    health += [(9.98, 10.01, True)] + [(t / 10, t / 10 + 0.01, False) for t in range(101, 150)]
    w = _watch([(0.0, True), (10.0, False), (20.0, True)], health)
    f = w.figures(5.0, 14.0)
    assert f["outage_while_ok_s"] == 0.0 and abs(f["no_worker_s"] - 4.0) < 0.03, f
    # ok answers to samples sent after the death do say ok after it: counted (10.0 to 10.1)
    health[100:102] = [(10.02, 10.03, True), (10.1, 10.11, True)]
    f = _watch([(0.0, True), (10.0, False), (20.0, True)], health).figures(5.0, 14.0)
    assert abs(f["outage_while_ok_s"] - 0.1) < 0.03 and abs(f["outage_while_ok_at"][0][0] - 5.0) < 0.02, f
