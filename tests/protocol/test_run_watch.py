"""How often a working volunteer reads the run's records (peer/host/run_watch.py): once a minute
while it works and its servers answer, every two announce periods otherwise."""

from __future__ import annotations

from types import SimpleNamespace

from peer.host.run_watch import CALM_READ_PERIOD_S, ReadSchedule, calm
from peer.server_links import LinkHealth


def test_a_calm_volunteer_reads_the_records_once_a_period_and_at_once_when_it_is_no_longer_calm():
    now = [100.0]
    schedule = ReadSchedule(announce_period=5.0, clock=lambda: now[0])
    assert schedule.look == 10.0 and schedule.calm_period == CALM_READ_PERIOD_S
    assert schedule.due(calm=True)  # the first look reads
    seen = []
    for _ in range(12):  # two minutes of looks every 10 s, calm
        now[0] += schedule.look
        seen.append(schedule.due(calm=True))
    assert seen == [False] * 5 + [True] + [False] * 5 + [True]
    now[0] += schedule.look
    assert schedule.due(calm=False) and schedule.due(calm=False)  # not calm: every look reads
    assert schedule.reads == 5
    # a long announce period: never read less often than every look
    assert ReadSchedule(announce_period=60.0).calm_period == 120.0


def test_calm_means_working_with_the_run_going_on_and_every_server_of_the_stage_answering():
    healthy, failing = LinkHealth("s0f0"), LinkHealth("s0b0")
    failing.failed(ConnectionError("refused"), dial=True)
    worker = SimpleNamespace(links={"s0f0": SimpleNamespace(health=healthy), "s0b0": SimpleNamespace(health=healthy)})
    going_on, stopped = SimpleNamespace(reason=None), SimpleNamespace(reason="stage 1 has no backward server")
    assert calm(worker, going_on) and calm(worker, None)
    assert not calm(None, going_on)  # not working yet (or between stages)
    assert not calm(worker, stopped)
    worker.links["s0b0"] = SimpleNamespace(health=failing)
    assert not calm(worker, going_on)
