"""The payload and sender checks a server's handlers share (parameter_server/checks.py), as a part on
its own: senders by stage and role, a result only for what its lease covers, batch and micro-batch in
range and not applied, and rows and tensors of this server's segment. Each refusal names what is
wrong."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from core.protocol.leases import LeaseTickets
from core.protocol.refusals import Refusal
from core.protocol.tasks import task_id
from core.protocol.wire import PayloadError
from parameter_server.checks import Checks
from parameter_server.directory import Directory
from parameter_server.updates import RETAIN

TICKETS = LeaseTickets(b"a test's lease key, 32 bytes ok!")
LAYOUT = SimpleNamespace(
    stages=[SimpleNamespace(frontal=("s0f0",), backward=("s0b0",), servers=["s0f0", "s0b0"])],
)


def make(version=5, reflow_from=None, replaying=False):
    directory = Directory(
        device_id="s0f0",
        peer_id="peer-s0f0",
        layout=lambda: LAYOUT,
        epoch=lambda: 0,
        version=lambda: version,
        replaying=lambda: replaying,
    )
    directory.update({"s0b0": "peer-s0b0"})
    return Checks(
        stage=0,
        rows=8,
        steps=20,
        micro_batches=2,
        seq=4,
        hidden=3,
        vocab=16,
        lease_tickets=TICKETS,
        directory=directory,
        layout=lambda: LAYOUT,
        epoch=lambda: 0,
        version=lambda: version,
        segment=lambda: (0, 4),
        reflow_from=lambda: reflow_from,
        replaying=lambda: replaying,
    )


def test_senders_by_stage_and_role():
    checks = make()
    assert checks.server_of("peer-s0b0", 0, "backward") == "s0b0"
    with pytest.raises(PayloadError, match="not a frontal server of stage 0"):
        checks.server_of("peer-s0b0", 0, "frontal")
    with pytest.raises(PayloadError, match="only its servers"):
        checks.only_servers("peer-volunteer")
    checks.only_servers("peer-s0b0")
    assert make(replaying=True).server_of("peer-anyone", 0, "frontal") == "replay"


def test_a_result_is_taken_only_for_what_its_lease_covers():
    checks = make()
    tid = task_id("forward", 5, 1, 0, (2, 6))
    ticket = TICKETS.issue(tid, "peer-v", 1, 0)
    checks.answers_lease(ticket, tid, "peer-v", "forward", 5, 1, rows=(2, 4))  # its rows in this segment
    checks.answers_lease(ticket, tid, "peer-v", "forward", 5, 1, rows=(2, 6), exact=True)
    for kind, t, m, rows, words in [
        ("backward", 5, 1, None, "is not a backward task"),
        ("forward", 6, 1, None, "of batch 6 micro-batch 1"),
        ("forward", 5, 0, None, "micro-batch 0"),
        ("forward", 5, 1, (2, 3), r"rows \[2, 3\) are not the rows \[2, 4\)"),
    ]:
        with pytest.raises(PayloadError, match=words):
            checks.answers_lease(ticket, tid, "peer-v", kind, t, m, rows=rows)
    with pytest.raises(PayloadError):
        checks.answers_lease(ticket, tid, "peer-other", "forward", 5, 1)  # another client's lease


def test_batches_in_range_and_not_applied():
    checks = make(version=5)
    assert checks.batch_micro({"batch": 3, "micro": 1}) == (3, 1)  # RETAIN - 1 applied batches still taken
    with pytest.raises(PayloadError) as e:
        checks.batch_micro({"batch": 5 - RETAIN, "micro": 0})
    assert e.value.refusal == Refusal.ALREADY_APPLIED
    assert make(version=5, reflow_from=2).batch_micro({"batch": 2, "micro": 0}) == (2, 0)  # re-run since a failover
    for meta, words in [
        ({"batch": 20, "micro": 0}, "outside the run's 0..19"),
        ({"batch": 6, "micro": 2}, "outside 0..1"),
    ]:
        with pytest.raises(PayloadError, match=words):
            checks.batch_micro(meta)


def test_rows_and_tensors_of_this_servers_segment():
    checks = make()
    hidden, labels = torch.zeros(2, 4, 3), torch.ones(2, 4, dtype=torch.int64)
    assert checks.rows_payload(
        {"batch": 6, "micro": 0, "rows": [2, 4]}, [hidden, labels], "inputs", ("hidden", "labels")
    ) == (6, 0, 2, 4)
    bad = [
        ({"batch": 6, "micro": 0, "rows": [2, 6]}, [hidden, labels], "outside this server's segment"),
        ({"batch": 6, "micro": 0, "rows": [2, 4]}, [hidden], "expects"),
        ({"batch": 6, "micro": 0, "rows": [2, 4]}, [hidden.double(), labels], "hidden"),
        ({"batch": 6, "micro": 0, "rows": [2, 4]}, [hidden, labels * 16], "token ids outside"),
        ({"batch": 6, "micro": 0, "rows": [2, 4]}, [torch.full((2, 4, 3), float("nan")), labels], "hidden"),
    ]
    for meta, tensors, words in bad:
        with pytest.raises(PayloadError, match=words):
            checks.rows_payload(meta, tensors, "inputs", ("hidden", "labels"))
