"""Liveness from records that outlive their writers (records.record_ttl): a record is stored for at
least MIN_RECORD_TTL, so whether its writer is there is how fresh it is, not whether it is found."""

from __future__ import annotations

import time

import pytest

from core.protocol import records
from peer.directory import Directory


def server_rec(device: str, written: float, state: str = "online") -> dict:
    return {
        "kind": "server",
        "device": device,
        "role": "frontal",
        "stage": 0,
        "state": state,
        "version": 1,
        "maddrs": [],
        "time": written,
    }


def test_a_record_lives_past_a_slow_store_and_goes_stale_after_three_periods():
    assert records.record_ttl(0.5) == records.MIN_RECORD_TTL == 15.0
    assert records.record_ttl(10.0) == 30.0
    now = 1000.0
    assert records.is_fresh(server_rec("a", now - 2.9), 1.0, now)
    assert not records.is_fresh(server_rec("a", now - 3.1), 1.0, now)


def test_a_server_is_silent_since_its_record_last_changed():
    d = Directory(dht=None, run_id="r", num_stages=1)
    assert d.silent_for("s0f0") == float("inf")  # never seen
    d._note(server_rec("s0f0", time.time() - 100.0))  # first seen 100 s old: a dead server's leftover
    assert 99.0 < d.silent_for("s0f0") < 110.0
    d._note(server_rec("s0f0", time.time() - 1.0))  # something new: it was there a read ago
    assert d.silent_for("s0f0") < 1.0
    fresh_at = time.time() - 1.0
    d._note(server_rec("s0f0", fresh_at))
    first = d.silent_for("s0f0")
    time.sleep(0.05)
    d._note(server_rec("s0f0", fresh_at))  # the same record read again: no news
    assert d.silent_for("s0f0") >= first + 0.04
    d._note(server_rec("s0f0", time.time(), state="offline"))  # it said it left
    assert d.silent_for("s0f0") == float("inf")


def test_a_stale_halt_notice_does_not_stop_the_run():
    d = Directory(dht=None, run_id="r", num_stages=1)
    halted = server_rec("s0f0", time.time() - 10.0) | {"halted": "stage 1 has no backward server"}
    d.records = {"peer": halted}
    assert d.halted(1.0) is None  # written 10 s ago by a server that stopped announcing
    d.records = {"peer": halted | {"time": time.time()}}
    assert d.halted(1.0) == "stage 1 has no backward server"


def test_stage_choice_reads_the_volunteers_its_servers_count_from_fresh_records_and_leaves_itself_out():
    """A volunteer choosing its stage reads the servers' records only: each counts the volunteers
    registered with it and their compute (a volunteer registers at every server of its stage, so the
    server that counts the most is taken); a stale record counts nothing; the deciding volunteer is
    taken out of its own stage's count; counts that are not numbers are ignored."""
    from core.layout import RunLayout
    from core.model.config import flops_per_token_per_layer, get_preset
    from peer.volunteer.stage_choice import stages_now

    cfg = get_preset("tiny")
    layout = RunLayout.even(2, cfg.layers)
    now = time.time()
    (a, b), (c, d) = (st.servers for st in layout.stages)

    def server(device, stage, count, rows_s, t=now, compute=0.0):
        stats = {"volunteers": count, "volunteer_compute": rows_s}
        return server_rec(device, t) | {"stage": stage, "compute": compute, "stats": stats}

    recs = [
        [("pa", server(a, 0, 3, 30.0, compute=5.0)), ("pb", server(b, 0, 2, 20.0))],
        [("pc", server(c, 1, 4, 40.0, t=now - 60.0)), ("pd", server(d, 1, "4", 40.0))],
    ]
    per_row = cfg.seq_len * flops_per_token_per_layer(cfg)
    layers = [st.layers[1] - st.layers[0] for st in layout.stages]
    fresh = stages_now(recs, layout, cfg, fresh=lambda r: records.is_fresh(r, 1.0, now))
    assert fresh[0].volunteer_flops == pytest.approx([10.0 * per_row * layers[0]] * 3)
    assert fresh[0].server_flops == {a: pytest.approx(5.0 * per_row * layers[0]), b: 0.0}
    assert fresh[1].volunteer_flops == [] and fresh[1].server_flops == {d: 0.0}  # stale, and junk counts
    every = stages_now(recs, layout, cfg)
    assert every[1].volunteer_flops == pytest.approx([10.0 * per_row * layers[1]] * 4)
    me = stages_now(recs, layout, cfg, own_stage=0, own_flops=10.0 * per_row * layers[0])
    assert me[0].volunteer_flops == pytest.approx([10.0 * per_row * layers[0]] * 2)


def test_a_peer_leaving_a_stream_handler_is_not_logged_as_an_error():
    """What a peer's connection closing leaves in hivemind's stream handler is logged at debug by a
    server's loop, not as an ERROR with a traceback: the handler's cancellation ("Exception in
    callback ... CancelledError", seen when a refused server left), and a read task's
    IncompleteReadError that hivemind never retrieves ("Task exception was never retrieved", seen in
    a restarted server's log; here a real task, collected unretrieved). Any other exception, in a
    callback or in an unretrieved task, is still an error."""
    import asyncio
    import gc
    import logging

    from peer.runtime import quiet_peer_departures

    class Kept(logging.Handler):  # on the loggers themselves: a CLI run in-process may stop propagation
        def __init__(self):
            super().__init__(logging.DEBUG)
            self.levels = []

        def emit(self, record):
            if "Exception in callback" in record.getMessage() or "never retrieved" in record.getMessage():
                self.levels.append(record.levelno)

    async def closed_mid_read():
        raise asyncio.IncompleteReadError(b"", 1)

    async def broken():
        raise ValueError("real")

    def left_unretrieved(loop, coro):
        task = loop.create_task(coro)
        loop.run_until_complete(asyncio.wait([task]))
        del task
        gc.collect()

    kept = Kept()
    watched = [logging.getLogger("hivepipe.runtime"), logging.getLogger("asyncio")]
    saved = [(lg, lg.level) for lg in watched]
    loop = asyncio.new_event_loop()
    try:
        for lg in watched:
            lg.addHandler(kept)
            lg.setLevel(logging.DEBUG)
        quiet_peer_departures(loop)
        loop.call_exception_handler({"message": "Exception in callback", "exception": asyncio.CancelledError()})
        left_unretrieved(loop, closed_mid_read())
        assert kept.levels == [logging.DEBUG, logging.DEBUG]
        kept.levels.clear()
        loop.call_exception_handler({"message": "Exception in callback", "exception": ValueError("real")})
        left_unretrieved(loop, broken())
        assert kept.levels == [logging.ERROR, logging.ERROR]
    finally:
        loop.close()
        for lg, level in saved:
            lg.removeHandler(kept)
            lg.setLevel(level)
