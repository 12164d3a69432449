"""Trust in one process (tests/swarm/inprocess.py, the servers' real handlers): a closed run
(`--volunteers-allow`), refusals for good, hoarders, liars under the tolerance and ahead of the
checks, bans ordered one at a time and rolled back as far as the kept versions allow. An outsider on
a run of real DHT nodes: tests/swarm/test_hosts_trust.py."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from core.protocol.refusals import Refusal
from core.protocol.wire import RemoteError
from parameter_server.service import StageServer
from peer.server_links import LocalLink
from tests.swarm.harness import reference_state, rel_diff
from tests.swarm.inprocess import InProcessSwarm, make_run

REPO = Path(__file__).resolve().parents[2]


def test_a_closed_run_admits_only_its_listed_volunteers():
    cfg, layout, run = make_run(steps=2)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    listed = frozenset(f"peer-u{k}0" for k in range(layout.num_stages))
    for server in swarm.servers.values():
        server.registry.volunteers_allow = listed

    async def attempt():
        server = swarm.servers["s0f0"]
        try:
            await LocalLink(server, "peer-intruder").call("register", {"device": "x", "compute": 1.0, "stage": 0})
            return None
        except RemoteError as e:
            return e.refusal, str(e)

    refused = asyncio.run(attempt())
    assert refused is not None and refused[0] is Refusal.NOT_ALLOWED and refused[0].final, refused
    assert "peer-intruder is not on this run's --volunteers-allow list" in refused[1]
    assert "peer-intruder" not in swarm.servers["s0f0"].clients
    asyncio.run(swarm.train())  # the listed volunteers (and the servers among themselves) train as before
    assert swarm.versions() == [2] * len(swarm.servers)


@pytest.mark.parametrize(
    "lines,words",
    [
        (["Qm-not-a-peer"], "line 1: 'Qm-not-a-peer' is not a peer id"),
        (["# ok", "", "xyz # comment"], "line 3: 'xyz' is not a peer id"),
    ],
)
def test_a_bad_allow_list_is_named(tmp_path, lines, words, capsys):
    from peer.cli import main

    allow = tmp_path / "allow.txt"
    allow.write_text("\n".join(lines))
    assert (
        main(
            [
                "serve",
                "--reliable",
                "--hold",
                "--stage",
                "0",
                "--role",
                "frontal",
                "--model",
                "tiny",
                "--run-key",
                str(tmp_path / "run.key"),
                "--volunteers-allow",
                str(allow),
            ]
        )
        == 2
    )
    assert words in capsys.readouterr().err
    assert not (tmp_path / "run.key").exists()


def test_a_volunteer_refused_for_good_stops_asking():
    """A volunteer not on a closed run's list is told so at its first call: it keeps the reason (peer
    join prints it once and exits 3) and stops, instead of registering again and again."""
    cfg, layout, run = make_run(steps=2)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=2, servers_compute=False)
    for server in swarm.servers.values():
        server.registry.volunteers_allow = frozenset({"peer-u00", "peer-u10"})
    intruder = next(w for w in swarm.workers if w.device_id == "u01")
    calls = []
    for server in swarm.servers.values():
        real = server.surface.handle

        async def counted(method, meta, tensors, sender, real=real):
            if sender == "peer-u01":
                calls.append(method)
            return await real(method, meta, tensors, sender)

        server.surface.handle = counted

    async def scenario():
        await asyncio.wait_for(intruder.run_loop(asyncio.Event()), 10.0)

    asyncio.run(scenario())
    assert intruder.refusal is Refusal.NOT_ALLOWED and "--volunteers-allow" in intruder.banned
    assert len(calls) <= 2 * len(layout.stages[0].servers), calls  # its first registration, and no loop


@pytest.mark.stress
def test_hoarders_hold_little_briefly_are_dropped_and_the_run_ends_exact(monkeypatch):
    """Three identities that take tasks and never answer (heartbeating that they hold them), from the
    first version on: each may hold two leases at a server, cut short to the probation deadline; three
    rounds of leases in a row run out and it is dropped, and may not register again for a while; its
    tasks go to the honest volunteers first, and an idle honest volunteer takes what a hoarder was
    given and does not answer (a backup: the first result wins). The run ends equal to the reference.
    (A client is dropped once its cut-short leases have doubled up to DROP_CAP_S, 8 s: 2 s here, so
    that a run of seconds sees it.)"""
    import parameter_server.clients

    monkeypatch.setattr(parameter_server.clients, "DROP_CAP_S", 2.0)
    steps = 60
    cfg, layout, run = make_run(steps=steps, stages=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=2, servers_compute=False)
    for worker in swarm.workers:  # (devices 3x slower than this processor: tasks wait in the queues for
        worker.device.slowdown = 3.0  # a hoarder to take, however fast the machine is at the moment)
    hoarders = [f"peer-hoard{i}" for i in range(3)]
    held = {(h, d): [] for h in hoarders for d in swarm.servers}
    refused, most_held, taken = [], [0], dict.fromkeys(hoarders, 0)
    stop = asyncio.Event()

    async def hoard():
        while not stop.is_set():
            for (h, d), tasks in held.items():
                link = LocalLink(swarm.servers[d], h)
                try:
                    await link.call("register", {"device": h[5:], "compute": 100.0, "stage": 0, "holding": tasks})
                    meta, _ = await link.call("take", {})
                    if meta.get("task"):
                        tasks.append(meta["task"])
                        taken[h] += 1
                except RemoteError as e:
                    refused.append(str(e))
                    tasks.clear()
                most_held[0] = max(most_held[0], len(swarm.servers[d].pool.leases_of(h)))
            await asyncio.sleep(0.05)

    def struck() -> int:
        return sum(s.counters.get("clients_struck_out", 0) for s in swarm.servers.values())

    gate = asyncio.Event()
    gate.set()

    def gated(server):  # the honest volunteers' takes wait while the gate is shut
        handle = server.surface.handle

        async def take_when_open(method, meta, tensors, sender):
            if method == "take" and not sender.startswith("peer-hoard"):
                await gate.wait()
            return await handle(method, meta, tensors, sender)

        server.surface.handle = take_when_open

    all_struck = asyncio.Event()  # set when the servers have dropped every hoarder

    def noting(server):  # a drop of struck-out clients says whether every hoarder is dropped now
        drop = server.registry.drop_struck_clients

        def drop_and_note():
            dropped = drop()
            if struck() >= len(hoarders):
                all_struck.set()
            return dropped

        server.registry.drop_struck_clients = drop_and_note

    for server in swarm.servers.values():
        gated(server)
        noting(server)

    async def scenario():
        started = []

        async def begin():
            started.append(asyncio.ensure_future(hoard()))

        async def every_hoarder_struck_before_the_end():
            # the run must not end before each hoarder has been dropped (on a loaded machine the
            # honest volunteers once finished the run first): if one has not, the honest take no new
            # task until it has, and the hoarders' leases keep running out meanwhile
            if struck() < len(hoarders):
                gate.clear()
                try:
                    await asyncio.wait_for(all_struck.wait(), 120.0)
                finally:
                    gate.set()

        try:
            return await swarm.train(timeout=300, at_version={1: begin, steps - 5: every_hoarder_struck_before_the_end})
        finally:
            stop.set()
            await asyncio.gather(*started)

    state = asyncio.run(scenario())
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
    assert most_held[0] <= 2  # START_LEASES: never earned more
    assert min(taken.values()) > 0, taken  # (every hoarder was given work to hold)
    assert struck() >= len(hoarders), (struck(), taken)
    assert sum(s.pool.stats()["backups"] for s in swarm.servers.values()) > 0
    assert any("may register again" in r for r in refused), refused[:3]


def run_with_a_liar(steps: int, liar: str, kind: str):
    """A 2-stage in-process run of `steps` steps, two volunteers a stage, servers not computing, the
    volunteer `liar` lying as `kind` (peer/volunteer/cheat.py): (final state, swarm, bans by peer)."""
    from peer.volunteer.cheat import Cheat

    cfg, layout, run = make_run(steps=steps, stages=2)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=2, servers_compute=False)
    next(w for w in swarm.workers if w.device_id == liar).cheat = Cheat(kind)
    state = asyncio.run(swarm.train(timeout=240))
    return state, swarm, {p: why for s in swarm.servers.values() for p, why in s.bans.banned.items()}


def test_a_volunteer_biased_under_the_tolerance_is_banned_and_its_work_rolled_back():
    """A volunteer that biases one coordinate of every result by 3e-4 of its norm passes every L2 check
    (tolerance 1e-3); its differences point the same way each time, and the drift test bans it within
    a few checks. The run rolls back its work and ends equal to the reference."""
    steps = 8
    state, swarm, bans = run_with_a_liar(steps, "u01", "bias")
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
    assert list(bans) == ["peer-u01"] and "the same way check after check" in bans["peer-u01"], bans
    checks = sum(n for s in swarm.servers.values() for (p, _), (_, n) in s.drift.sums.items() if p == "peer-u01")
    caught = sum(s.verify_counts.get("drift_caught", 0) for s in swarm.servers.values())
    assert caught >= 1 and all(
        n <= 20 for s in swarm.servers.values() for (p, _), (_, n) in s.drift.sums.items() if p == "peer-u01"
    ), checks


def test_a_volunteer_that_scales_its_results_under_the_tolerance_is_banned_and_its_work_rolled_back():
    """Every result scaled by 1 + 1e-4 passes every L2 check (tolerance 1e-3), and its difference from
    a re-run is the result itself, a new vector each check (the drift test's random directions do not
    see it; the fuzzer found it). Along the result it points the same way every time: banned within a
    few checks, its work rolled back, the run equal to the reference."""
    steps = 8
    state, swarm, bans = run_with_a_liar(steps, "u01", "creep")
    assert list(bans) == ["peer-u01"] and "the same way check after check" in bans["peer-u01"], bans
    assert all(n <= 20 for s in swarm.servers.values() for (p, _), (_, n) in s.drift.sums.items() if p == "peer-u01")
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5


def test_an_input_gradient_sent_without_its_gradient_push_is_checked_on_its_own():
    """A last-stage volunteer sends its input gradient x100 (relayed to the previous stage at once) and
    hands the task back: the gradient push that would have checked it never comes, and the honest
    re-run's input gradient is a duplicate. When the re-run's push is credited, the frontal server
    re-runs the orphaned input gradient on its own: the liar is banned, its work rolled back, and the
    run ends equal to the reference (0.13 from it before)."""
    steps = 6
    state, _, bans = run_with_a_liar(steps, "u11", "relay")
    assert list(bans) == ["peer-u11"] and "with no gradient push of its own" in bans["peer-u11"], bans
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-6


def test_forward_tasks_handed_in_without_their_outputs_are_run_again(monkeypatch):
    """A volunteer hands its forward tasks in as done without ever pushing their outputs: the backward
    server lacks those rows for good, and the run hung. A batch that waits asks the frontal server to
    reopen the done tasks owing them; others run them, and the run ends equal to the reference."""
    from parameter_server import rescue

    monkeypatch.setattr(rescue, "RESCUE_MIN", 1.0)
    monkeypatch.setattr(rescue, "RESCUE_PERIOD", 0.5)
    steps = 4
    state, swarm, _ = run_with_a_liar(steps, "u01", "unsent")
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-6
    fs = swarm.servers[swarm.layout.stages[0].frontal[0]]
    liar = next(w for w in swarm.workers if w.device_id == "u01")
    assert fs.counters.get("tasks_reopened", 0) >= 1 and liar.stats["forward"] >= 1, fs.counters


def test_noise_under_the_tolerance_where_the_gradient_is_zero_is_caught():
    """A volunteer adds noise of 5e-4 of the norm (under the 1e-3 tolerance) on 200 coordinates of its
    gradients whose true value is zero, random signs each push: AdamW would move each such coordinate
    by about a learning-rate step (0.018 from the reference after a short run). The check compares
    the push with the re-run where the re-run is zero: banned, and the run equal to the reference."""
    steps = 6
    state, _, bans = run_with_a_liar(steps, "u01", "support")
    assert list(bans) == ["peer-u01"] and "where the re-run's is zero" in bans["peer-u01"], bans
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-6


def test_a_ban_outlives_the_coordinator_that_ordered_it():
    """The run's first server bans a volunteer on every server and is lost before it sends the ban's
    rollback epoch (frozen there in the third trust pass, the liar's work stayed applied: 0.27 from the
    reference). Every server kept the ban in its log; the failover makes another server the run's
    first, which orders the ban's epoch itself: banned everywhere, rolled back to the volunteer's
    first batch, and the run (the banned volunteer was honest here) ends equal to the reference."""
    steps = 8
    cfg, layout, run = make_run(steps=steps, stages=2, frontal=2, backward=2)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=2, servers_compute=False)
    first = layout.stages[0].frontal[0]
    records = []

    async def ban_then_die():
        for d, server in list(swarm.servers.items()):
            await server.bans.on_ban({"peer": "peer-u01", "why": "a test's ban"}, [], f"peer-{first}")
        records.append(await swarm.lose(first))

    state = asyncio.run(swarm.train(timeout=240, at_version={3: ban_then_die}))
    assert records[0]["lost"] == [first] and "peer-u01" not in records[0].get("banned", [])
    for server in swarm.servers.values():
        assert "peer-u01" in server.bans.ordered() and server.epoch >= 2 and not server.bans.pending
        assert server.epoch_record.get("rollback_to") is not None or server.epoch_record["epoch"] > 2
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-6


def unsampled_swarm(steps: int, volunteers_per_stage: int):
    """A 2-stage `tiny` swarm of servers that do not compute, whose sample rate is 0 past probation
    (only probation and the push checks re-run work): the swarm, the last stage's volunteer u11 (the
    liar to be) and the last stage's servers (its judges)."""
    cfg, layout, run = make_run(steps=steps, stages=2)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=volunteers_per_stage, servers_compute=False)
    for server in swarm.servers.values():
        server.arrivals.verify_rate = 0.0
    liar = next(w for w in swarm.workers if w.device_id == "u11")
    return swarm, liar, [s for s in swarm.servers.values() if s.stage == 1]


def test_a_patient_liar_past_probation_is_checked_at_its_first_outsized_push():
    """A volunteer honest through its probation, then scaling its results x1e4, with a sample rate of
    0 past probation: no draw would ever check it again. A push whose norm per row passes 4x the median
    of its slot's recent pushes is re-run whatever the sample says: the liar is banned at its first
    lie, and its work rolled back (a patient liar at 1-5% of its tasks stayed applied before)."""
    from peer.volunteer.cheat import Cheat

    steps = 14
    swarm, liar, judges = unsampled_swarm(steps, volunteers_per_stage=2)
    armed = []

    def lie_past_probation(slot: int, batch: int) -> None:  # (at each push credited: its probation over?)
        if not armed and all(s.arrivals.checks_passed.get("peer-u11", 0) >= s.arrivals.probation for s in judges):
            liar.cheat = Cheat("scale", after=liar.stats["forward"] + liar.stats["backward"])
            armed.append(min(swarm.versions()))

    for server in judges:
        server.updates.on_credit.append(lie_past_probation)
    state = asyncio.run(swarm.train(timeout=240))
    bans = {p: why for s in swarm.servers.values() for p, why in s.bans.banned.items()}
    assert armed and armed[0] < steps - 2, armed  # (lies began with batches left to lie on)
    assert list(bans) == ["peer-u11"] and "(relative L2) from this server's re-run" in bans["peer-u11"], bans
    assert sum(s.verify_counts.get("unusual_norms", 0) for s in judges) >= 1
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-6


@pytest.mark.stress
def test_a_patient_liar_that_flips_signs_past_probation_is_checked_by_the_direction_of_its_pushes():
    """A patient liar on the last stage whose lies keep their norm: every result of one task in 2
    negated. It is the first of the stage's 3 volunteers whose probation is over at both of the
    stage's servers while the direction check is on for it (the event, looked at as each push is
    credited: which volunteer gets work follows the machine's load). Sample rate 0 past probation, so
    only a push's direction can get it checked: a push that agrees with its slot's AdamW first moment
    less than all but 5% of the slot's recent pushes by others is re-run, on a slot whose pushes agree
    with it (the one holding the output head). The liar is banned and its work rolled back; the run
    equals the reference (never banned without the check)."""
    from parameter_server.arrivals import direction_bar
    from peer.volunteer.cheat import Cheat

    steps = 30
    swarm, _, judges = unsampled_swarm(steps, volunteers_per_stage=3)
    stage_1 = [w for w in swarm.workers if w.device_id.startswith("u1")]
    armed = []

    def direction_checked(server, peer: str) -> bool:  # (the slot's pushes by others agree with its moment)
        return direction_bar(server.arrivals.push_cosines.get(server.slot, ()), peer) is not None

    def arm(slot: int, batch: int) -> None:
        for w in [] if armed else stage_1:
            peer = f"peer-{w.device_id}"
            if all(s.arrivals.checks_passed.get(peer, 0) >= s.arrivals.probation for s in judges) and any(
                direction_checked(s, peer) for s in judges
            ):
                w.cheat = Cheat("signflip", after=w.stats["forward"] + w.stats["backward"], every=2)
                armed.append((peer, min(swarm.versions())))
                return

    for server in judges:
        server.updates.on_credit.append(arm)
    state = asyncio.run(swarm.train(timeout=240))
    bans = {p: why for s in swarm.servers.values() for p, why in s.bans.banned.items()}
    seen = {
        s.device_id: (s.verify_counts, [(w[-3:], round(c, 2)) for w, c in s.arrivals.push_cosines[s.slot]])
        for s in judges
    }
    done = {w.device_id: w.stats["forward"] + w.stats["backward"] for w in stage_1}
    assert armed and armed[0][1] < steps - 10, (done, seen)  # (lies began with batches left to lie on)
    assert list(bans) == [armed[0][0]], (bans, armed, done, seen)
    assert sum(s.verify_counts.get("unusual_directions", 0) for s in judges) >= 1
    assert sum(s.verify_counts.get("unusual_norms", 0) for s in judges) == 0  # (its norms were honest)
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-6


def test_a_liar_cannot_outrun_checks_that_fall_behind(monkeypatch):
    """On a loaded machine a server's checks queue behind each other (one thread) and fall behind the
    run: the same biased liar, with every re-run made 0.3 s slower, is still rolled back entirely,
    because a step waits for the checks of work it would otherwise put beyond a rollback's reach."""
    from peer.volunteer.cheat import Cheat

    original = StageServer.recompute

    async def loaded(self, version, fn):
        def slow(model):
            time.sleep(0.3)
            return fn(model)

        return await original(self, version, slow)

    monkeypatch.setattr(StageServer, "recompute", loaded)
    steps = 10
    cfg, layout, run = make_run(steps=steps, stages=2)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=2, servers_compute=False)
    next(w for w in swarm.workers if w.device_id == "u01").cheat = Cheat("bias")
    state = asyncio.run(swarm.train(timeout=300))
    bans = {p for s in swarm.servers.values() for p in s.bans.banned}
    assert bans == {"peer-u01"}, bans
    held = sum(s.verify_counts.get("steps_held_for_checks", 0) for s in swarm.servers.values())
    assert held >= 1
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5


def test_a_ban_waits_for_a_server_the_coordinator_cannot_reach_yet():
    """Early in a run the coordinator's directory may not list a server of another stage yet: the ban
    is tried again until it can be sent (it was lost before, the liar's work staying applied), and the
    run (its banned volunteer honest here) still ends equal to the reference."""
    steps = 8
    cfg, layout, run = make_run(steps=steps, stages=2)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=2, servers_compute=False)
    records, refused = [], []

    async def ban():
        coordinator = swarm.servers[layout.stages[0].frontal[0]]
        connect, other = coordinator.connector, layout.stages[1].frontal[0]

        def not_yet(d):
            if d == other and len(refused) < 3:
                refused.append(d)
                return None
            return connect(d)

        coordinator.connector = not_yet
        records.append(await coordinator.bans.ban_and_roll_back("peer-u01", "a test's ban"))

    state = asyncio.run(swarm.train(timeout=240, at_version={3: ban}))
    (record,) = records
    assert len(refused) == 3 and record["banned"] == ["peer-u01"] and "rollback_to" in record, record
    assert all("peer-u01" in s.bans.banned for s in swarm.servers.values())
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5


def test_a_ban_made_here_while_another_is_ordered_is_still_ordered_in_its_turn():
    """The coordinator catches a volunteer itself while it orders another's ban: that second ban waits
    for the first, and gets its own epoch and rollback. (The first epoch used to list every peer banned
    at the coordinator, the second then read as done: with four liars, the work of one stayed applied
    without a word, 0.03-0.1 from the reference.) Both volunteers honest: the run ends exact."""
    steps = 8
    cfg, layout, run = make_run(steps=steps, stages=2)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=2, servers_compute=False)
    records = []

    async def bans():
        coordinator = swarm.servers[layout.stages[0].frontal[0]]
        coordinator.bans.ban_here("peer-u11", "caught by the coordinator's own check")  # (its ban awaits the lock)
        records.append(await coordinator.bans.ban_and_roll_back("peer-u01", "a test's ban"))
        records.append(await coordinator.bans.ban_and_roll_back("peer-u11", "caught by the coordinator's own check"))

    state = asyncio.run(swarm.train(timeout=240, at_version={3: bans}))
    first, second = records
    assert first["banned"] == ["peer-u01"], first
    assert second is not None and second["epoch"] == first["epoch"] + 1, second
    assert second["banned"] == ["peer-u01", "peer-u11"]
    assert all({"peer-u01", "peer-u11"} <= set(s.bans.banned) for s in swarm.servers.values())
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5


def test_an_input_gradient_relayed_is_work_a_ban_rolls_back_to():
    """A volunteer's input gradient goes on to the previous stage at once, which may apply the batch
    with it before the volunteer's own gradient push (checked with it) arrives, or if that push never
    does (a liar banned first): the frontal server that relayed it answers a ban with that batch as
    the volunteer's first work, so the rollback reaches it."""
    from tests.swarm.inprocess import TICKETS

    cfg, layout, run = make_run(stages=2, steps=3)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    fs1 = swarm.servers[layout.stages[1].frontal[0]]
    rows = fs1.rows // len(layout.stages[1].frontal)
    task = f"F1.0.1.0-{rows}"
    gin = {"task": task, "batch": 1, "micro": 0, "rows": [0, rows], "lease": TICKETS.issue(task, "peer-u10", 1, 0)}

    async def scenario():
        link = LocalLink(fs1, "peer-u10")
        await link.call("register", {"device": "u10", "compute": 1.0, "stage": 1})
        answer, _ = await link.call("push_input_grads", gin, [torch.zeros(rows, cfg.seq_len, cfg.hidden)])
        assert answer["result"] == "accepted", answer
        return await fs1.bans.on_ban({"peer": "peer-u10", "why": "a test's ban"}, [], "peer-s0f0")

    told = asyncio.run(scenario())
    assert told["first_batch"] == 1, told


def test_work_on_probation_stays_within_a_rollbacks_reach():
    """Every server keeps the versions back to the first work of any volunteer still on probation at
    any server of the run (its pin, sent to every server): a ban late in the run still rolls back to
    that volunteer's first batch, far beyond the kept versions. (Probation here lasts the whole run at
    stage 0 and is off at stage 1; the banned volunteer was honest, so the run still ends equal to the
    reference.)"""
    steps = 14
    cfg, layout, run = make_run(steps=steps, stages=2)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=2, servers_compute=False)
    for server in swarm.servers.values():  # stage 1's servers keep the old versions for stage 0's pins
        server.arrivals.probation = 10_000 if server.stage == 0 else 0
    records, kept = [], []

    async def ban():
        coordinator = swarm.servers[layout.stages[0].frontal[0]]
        kept.append({d: min(sh.kept_from() for sh in s.hosted.values()) for d, s in swarm.servers.items()})
        records.append(await coordinator.bans.ban_and_roll_back("peer-u01", "a test's ban"))

    state = asyncio.run(swarm.train(timeout=240, at_version={10: ban}))
    (record,), (oldest,) = records, kept
    keep = next(iter(swarm.servers.values())).shard.keep_versions
    assert 10 - keep > 1 and all(v <= 1 for v in oldest.values()), (keep, oldest)  # pinned on every stage
    assert record["rollback_to"] <= 1, record
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5


def test_a_volunteer_whose_probation_ends_drifting_stays_pinned_to_its_first_work():
    """A pin holds a volunteer's first batch while it is on probation, and after its probation too if
    its differences drift one way by then (a liar under the tolerance drifts from its 3rd check: it
    passed 4 checks and was banned at its 5th with its first batches unpinned); one whose probation
    ends clean is pinned again only by its work in the kept window, and only while it drifts."""
    from parameter_server.clients import ClientInfo

    cfg, layout, run = make_run(steps=30, stages=1)
    server = next(iter(InProcessSwarm(cfg, layout, run, servers_compute=False).servers.values()))
    want = torch.ones(64)
    bias = torch.zeros(64)
    bias[3] = 3e-4 * float(want.norm())
    for peer in ("peer-liar", "peer-honest"):
        server.clients[peer] = ClientInfo(peer, 1.0, server.clock())
        server.arrivals.note_contribution(peer, 2)
    assert server.arrivals.unsettled_first() == 2
    gen = torch.Generator().manual_seed(0)
    for n in range(server.arrivals.probation):
        for peer, got in (("peer-liar", want + bias), ("peer-honest", want + 1e-8 * torch.randn(64, generator=gen))):
            server.arrivals.note_contribution(peer, 3 + n)
            server.drift.add(peer, "outputs", got, want)
            server.passed_check(peer, [])
    assert server.arrivals.cleared == {"peer-honest"} and server.drift.suspicious("peer-liar")
    for batches in server.arrivals.contributed.values():
        batches.discard(2)  # (the kept window moved past batch 2: its first work is remembered apart)
    assert server.arrivals.unsettled_first() == 2  # the liar's first batch, though its probation is over
    del server.clients["peer-liar"]
    assert server.arrivals.unsettled_first() is None  # gone: nothing to ban; the honest one is cleared


def test_which_work_is_checked_cannot_be_computed_from_what_a_volunteer_knows():
    """The sample past probation is drawn from a secret of the server's own: two servers started with
    the same run (seed, layout, name) check different contributions of the same volunteer, so a liar
    that knows everything public cannot tell which of its pushes will be re-run."""
    from parameter_server.clients import ClientInfo

    cfg, layout, run = make_run(steps=30, stages=1)
    device = layout.stages[0].frontal[0]
    drawn = []
    for _ in range(2):
        server = InProcessSwarm(cfg, layout, run, servers_compute=False).servers[device]
        server.clients["peer-x"] = ClientInfo("peer-x", 1.0, server.clock())
        server.arrivals.checks_passed["peer-x"] = server.arrivals.probation  # past probation: the sample decides
        drawn.append([server.arrivals.note_contribution("peer-x", 2) for _ in range(200)])
    assert drawn[0] != drawn[1]
    assert all(0.01 < sum(d) / len(d) < 0.3 for d in drawn), [sum(d) for d in drawn]  # about verify_rate (0.1)


def test_work_that_k_servers_receive_is_rerun_by_one_of_them_at_the_verify_rate():
    """Each of the k servers a push goes to draws apart with p = 1 - (1 - rate)^(1/k): at rate 1.0 every
    push is checked (at rate / k, one of two servers' pushes in four went unchecked, and a test's liar
    with every push "checked" went unbanned 1 run in 64); at 0.1 one of two servers re-runs it 10% of
    the time."""
    import random

    from parameter_server.clients import ClientInfo

    cfg, layout, run = make_run(steps=30, stages=1)
    server = InProcessSwarm(cfg, layout, run, servers_compute=False).servers[layout.stages[0].frontal[0]]
    server.clients["peer-x"] = ClientInfo("peer-x", 1.0, server.clock())
    server.arrivals.checks_passed["peer-x"] = server.arrivals.probation  # past probation: the sample decides
    server.arrivals.rng = random.Random(0)  # (the test's draws fixed; the server's own come from os.urandom)

    def one_of(k: int) -> bool:  # k servers' draws for the same push
        return any([server.arrivals.note_contribution("peer-x", 2, shared_by=k) for _ in range(k)])

    server.arrivals.verify_rate = 1.0
    assert all(one_of(2) for _ in range(500)) and all(one_of(4) for _ in range(500))
    server.arrivals.verify_rate = 0.1
    for k in (1, 2, 4):
        share = sum(one_of(k) for _ in range(4000)) / 4000
        assert 0.085 < share < 0.115, (k, share)  # (binomial sd 0.0047)


def test_a_ban_whose_liar_worked_before_the_kept_versions_rolls_back_as_far_as_a_rerun_can_start():
    """The ban of a volunteer whose first work is older than every version kept rolls back to the oldest
    version a re-run can start from: batch t re-runs on version t - 1, so the oldest version kept is the
    re-run's start, not the rollback's target (rolled back onto it, the run waited for ever for the
    version before it). The banned volunteer here was honest, so the run still ends equal to the reference."""
    steps = 14
    cfg, layout, run = make_run(steps=steps, stages=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=2, servers_compute=False)
    # no probation: a volunteer still on it pins the versions from its first batch on (verify.py), and on
    # a loaded machine one still was at version 9 (version 0 kept, the rollback rightly went to 0): the
    # kept versions here are the window alone, which the volunteer's first work is older than
    for server in swarm.servers.values():
        server.arrivals.probation = 0
    records = []

    async def ban():
        coordinator = swarm.servers[layout.stages[0].frontal[0]]
        for server in swarm.servers.values():
            server.arrivals.contributed.setdefault("peer-u01", set()).add(0)  # (as if its first work were batch 0)
        records.append(await coordinator.bans.ban_and_roll_back("peer-u01", "a test's ban"))

    state = asyncio.run(swarm.train(timeout=240, at_version={9: ban}))
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
    (record,) = records
    shard = next(iter(swarm.servers.values())).shard
    assert record["rollback_to"] > 0 and record["rollback_to"] >= 9 - shard.keep_versions + 2, record


# a rollback's lineage: the versions after its batch are made again; what was made of the undone ones
# before a server adopted the rollback must not reach the new lineage through a read or a copy


def _rolled_back_at_one_server(steps: int, recipe=None):
    """A finished one-stage run (a frontal and a backward server, each keeping the other's replica)
    whose backward server adopted a rollback to version steps - 1 that its frontal server has not yet."""
    cfg, layout, run = make_run(steps=steps, stages=1, frontal=1, backward=1, recipe=recipe)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    fs, bs = (swarm.servers[d] for d in layout.stages[0].servers)
    asyncio.run(swarm.train(timeout=120))
    record = {"epoch": 1, "layout": layout.to_dict(), "from_batch": steps - 1, "rollback_to": steps - 1}
    return fs, bs, record


@pytest.mark.stress
def test_a_version_is_read_from_the_lineage_of_the_readers_layout_epoch():
    """`get_params` with the reader's layout epoch (a volunteer's task, a server's check): a host that
    has not adopted the reader's epoch yet answers 'retry' (its versions after the rollback's batch
    are the undone ones; a volunteer once computed on them and its honest work was banned), and
    answers from the new lineage once it adopts; a reader of an older epoch is refused as stale; a
    reader that names no epoch (the launcher's assembled model) is answered as before."""
    steps = 5
    fs, bs, record = _rolled_back_at_one_server(steps)
    bs.epochs.adopt(record)
    ask = {"slot": fs.slot, "version": steps, "wait": 0}

    async def scenario():
        from_fs = LocalLink(fs, bs.peer_id)
        early = (await from_fs.call("get_params", dict(ask, epoch=1)))[0]
        unnamed = (await from_fs.call("get_params", ask))[0]
        waiting = asyncio.ensure_future(from_fs.call("get_params", dict(ask, epoch=1, version=steps - 1, wait=5)))
        await asyncio.sleep(0)  # (it waits on the server's side: adopting the epoch wakes it)
        assert not waiting.done()
        fs.epochs.adopt(record)
        adopted = (await waiting)[0]
        with pytest.raises(RemoteError) as stale:
            await LocalLink(bs, fs.peer_id).call("get_params", dict(ask, slot=bs.slot, epoch=0))
        return early, unnamed, adopted, stale.value

    early, unnamed, adopted, stale = asyncio.run(scenario())
    assert early == {"retry": True, "version": steps}
    assert unnamed["version"] == steps and "retry" not in unnamed
    assert adopted["version"] == steps - 1 and "retry" not in adopted
    assert stale.refusal is Refusal.STALE_EPOCH


@pytest.mark.stress
def test_a_replica_copy_made_before_a_rollback_is_refused_where_the_rollback_is_adopted():
    """A copy of a slot made before a ban's rollback (a version of the undone lineage: its batch
    totals held the banned work's norms) that reaches the replica once the replica's server adopted
    the rollback is refused as of a stale epoch and changes nothing: taken, its totals answered for
    the re-run batches' norms (a clipped run with a liar once ended 1.9e-2 from the reference)."""
    from tests.swarm.test_recipe_swarm import CLIPPED

    steps = 5
    fs, bs, record = _rolled_back_at_one_server(steps, recipe=CLIPPED)
    meta, tensors = fs.hosted[fs.slot].export(steps)  # made at epoch 0, then on its way
    assert bs.clipping.run_total(steps - 1) is not None
    bs.epochs.adopt(record)
    replica = bs.replicas[fs.slot]
    assert replica.version == steps - 1 and bs.clipping.run_total(steps - 1) is None

    taken = asyncio.run(fs.outbox.deliver(bs.device_id, "push_replica", dict(meta, slot=fs.slot), tensors, attempts=3))
    assert not taken
    assert bs.replicas[fs.slot] is replica and replica.version == steps - 1
    assert steps - 1 not in replica.totals and bs.clipping.run_total(steps - 1) is None


@pytest.mark.stress
def test_a_slice_built_for_a_version_a_rollback_re_made_is_not_computed_on(monkeypatch):
    """A worker builds the slice of a version in its compute thread. One built for a task of the old
    layout epoch, still building when the worker met the rollback's epoch (which clears what it held),
    is stored after the clear; the worker then holds the re-made version's parameters, and its next
    task must compute on those, not on that slice (an honest volunteer's outputs were 0.234 from its
    check, and it was banned, in 1 of 20 runs of the re-evaluation test in the stress tier)."""
    import threading

    import peer.volunteer.versions as versions_module

    cfg, layout, run = make_run(steps=4, stages=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    worker = swarm.workers[0]
    undone = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    remade = {n: v + 0.5 for n, v in undone.items()}
    building, release = threading.Event(), threading.Event()
    build = versions_module.slice_from_state

    def slow_first(*args, **kwargs):
        if not building.is_set():
            building.set()
            release.wait(30)
        return build(*args, **kwargs)

    monkeypatch.setattr(versions_module, "slice_from_state", slow_first)
    worker.versions.hold(3, undone)
    old_task = threading.Thread(target=worker.versions.model, args=(3,))  # (the compute thread of the old epoch's task)
    old_task.start()
    assert building.wait(30)
    worker.versions.clear()  # what refresh_layout clears when the rollback's epoch is met
    worker.versions.hold(3, remade)  # the re-made version 3, fetched in the new epoch
    release.set()
    old_task.join(30)
    computed_on = worker.versions.model(3).state_dict()
    assert all(torch.equal(computed_on[n], remade[n]) for n in remade)
