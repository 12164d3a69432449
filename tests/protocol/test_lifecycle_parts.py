"""The parts of a peer's life (peer.host), each on its own, with time injected: the state line, the
failure detector, the comparison of a server's flags with the run's, the reachability advice, and
the CLI's one-line errors."""

from __future__ import annotations

import asyncio
import io

import pytest

from core.layout import RunLayout
from peer.host.failures import FailureDetector
from peer.host.run_config import differing_flags
from peer.host.state import PeerState, StateLine
from peer.reachability import advice_for


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_state_is_said_once_and_a_wait_is_reminded_once_a_minute():
    clock, out = Clock(), io.StringIO()
    line = StateLine("s0f0", out=out, clock=clock)
    assert line.say(PeerState.STARTING, "run demo")
    assert line.say(PeerState.WAITING, "for s0b0")
    for _ in range(50):  # polled every second: no new line until a minute has passed
        clock.t += 1.0
        assert not line.say(PeerState.WAITING, "for s0b0")
    clock.t += 10.0
    line.say(PeerState.WAITING, "for s0b0")
    assert line.say(PeerState.WAITING, "for s1f0")  # what it waits for changed: said at once
    assert line.say(PeerState.SERVING, "stage 0 frontal")
    clock.t += 600.0
    assert not line.say(PeerState.SERVING, "stage 0 frontal")  # serving is not reminded
    assert out.getvalue().splitlines() == [
        "s0f0: starting: run demo",
        "s0f0: waiting: for s0b0",
        "s0f0: waiting: still for s0b0 (60 s)",
        "s0f0: waiting: for s1f0",
        "s0f0: serving: stage 0 frontal",
    ]
    assert [s for s, _ in line.history] == [
        PeerState.STARTING,
        PeerState.WAITING,
        PeerState.WAITING,
        PeerState.SERVING,
    ]


def test_progress_is_said_once_a_period_while_serving_and_never_otherwise():
    clock, out = Clock(), io.StringIO()
    line = StateLine("s0f0", out=out, clock=clock)
    line.say(PeerState.WAITING, "for s0b0")
    clock.t += 120.0
    assert not line.progress("step 0/10")  # not serving
    line.say(PeerState.SERVING, "stage 0 frontal")
    clock.t += 59.0
    assert not line.progress("step 3/10")  # its first a period after serving began
    clock.t += 1.0
    assert line.progress("step 4/10, loss 5.1000")
    for _ in range(59):
        clock.t += 1.0
        assert not line.progress("step 5/10")
    clock.t += 1.0
    assert line.progress("step 9/10, about 12 s left")
    line.say(PeerState.FINISHED, "run demo finished at step 10")
    clock.t += 600.0
    assert not line.progress("step 10/10")
    assert [x for x in out.getvalue().splitlines() if "progress" in x] == [
        "s0f0: progress: step 4/10, loss 5.1000",
        "s0f0: progress: step 9/10, about 12 s left",
    ]
    assert line.line() == "finished: run demo finished at step 10"  # (progress is not a state)


@pytest.mark.parametrize(
    "seconds,text",
    [
        (0, "0 s"),
        (44.6, "45 s"),
        (89, "89 s"),
        (90, "2 min"),
        (720, "12 min"),
        (5400, "1.5 h"),
        (3 * 86400, "3.0 days"),
    ],
)
def test_a_duration_reads_as_a_person_says_it(seconds, text):
    from core.protocol.values import format_duration

    assert format_duration(seconds) == text


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "5", None])
def test_a_duration_that_is_not_one_is_refused(bad):
    from core.protocol.values import format_duration

    with pytest.raises(ValueError, match="a duration must be a finite number >= 0"):
        format_duration(bad)


def test_the_reminder_period_comes_from_the_environment_and_a_bad_one_is_named(monkeypatch):
    from peer.errors import UsageError
    from peer.host.state import REMIND_ENV

    monkeypatch.setenv(REMIND_ENV, "5")
    clock, out = Clock(), io.StringIO()
    line = StateLine("s0f0", out=out, clock=clock)
    line.say(PeerState.WAITING, "for s0b0")
    clock.t += 4.0
    assert not line.say(PeerState.WAITING, "for s0b0")
    clock.t += 1.0
    line.say(PeerState.WAITING, "for s0b0")
    assert out.getvalue().splitlines()[-1] == "s0f0: waiting: still for s0b0 (5 s)"
    for bad in ("0", "-1", "soon", "inf", "nan"):
        monkeypatch.setenv(REMIND_ENV, bad)
        with pytest.raises(UsageError, match=f"{REMIND_ENV}='{bad}' is not a positive number of seconds"):
            StateLine("s0f0")


class Directory:
    def __init__(self, silent: dict[str, float]):
        self.silent = silent

    def silent_for(self, device: str) -> float:
        return self.silent.get(device, 0.0)


class Server:
    def __init__(self, layout, version=1, steps=10):
        self.layout, self.version, self.halted = layout, version, None
        self.run = type("Run", (), {"steps": steps})()
        self.failed_over: list[list[str]] = []
        self.epochs = self  # (the server's layout epochs part: this fake's own fail_over)

    async def fail_over(self, lost):
        self.failed_over.append(list(lost))
        return {"epoch": 1, "from_batch": self.version}


def _detector(silent, up=(), device="s0f0", failover_after=30.0, **server_kw):
    layout = RunLayout.even(2, 4, 2, 1)  # two frontal servers a stage: one can be failed over
    server = Server(layout, **server_kw)
    clock = Clock()

    async def answers(d):
        return d in up

    det = FailureDetector(server, Directory(silent), device, 3.0, failover_after, answers, clock=clock)
    return det, server, clock


def test_a_silent_server_is_failed_over_only_after_failover_after_and_only_if_it_does_not_answer():
    det, server, clock = _detector({"s1f1": 100.0})
    assert asyncio.run(det.check()) == []  # just noticed
    clock.t += 29.0
    assert asyncio.run(det.check()) == []
    clock.t += 2.0
    assert asyncio.run(det.check()) == ["s1f1"]
    assert server.failed_over == [["s1f1"]] and server.halted is None


def test_a_silent_server_that_answers_a_ping_is_not_lost():
    det, server, clock = _detector({"s1f1": 100.0}, up=("s1f1",))
    asyncio.run(det.check())
    clock.t += 60.0
    assert asyncio.run(det.check()) == [] and server.failed_over == []


def test_only_the_first_remaining_server_fails_over_and_a_roles_last_server_stops_the_run():
    det, server, clock = _detector({"s1f1": 100.0}, device="s0b0")
    asyncio.run(det.check())
    clock.t += 31.0
    assert asyncio.run(det.check()) == [] and server.failed_over == []  # s0f0 does it
    det, server, clock = _detector({"s1b0": 100.0})
    asyncio.run(det.check())
    clock.t += 31.0
    assert asyncio.run(det.check()) == []
    assert "stage 1 has no backward server (s1b0 gone)" in server.halted


def test_a_server_that_said_the_run_finished_is_not_failed_over_but_one_lost_at_the_end_is():
    det, server, clock = _detector({"s1f1": 100.0, "s1f0": 100.0}, version=10, steps=10)
    det.directory.finished = {"s1f0"}
    asyncio.run(det.check())
    clock.t += 100.0
    assert asyncio.run(det.check()) == ["s1f1"] and server.failed_over == [["s1f1"]]


def test_the_flags_a_server_disagrees_on_are_named_with_both_values():
    ours = {"model": "tiny", "steps": 20, "lr": 0.002, "layout": {"a": 1}, "seed": 0}
    assert differing_flags(ours, dict(ours, epoch=0)) == []
    theirs = dict(ours, steps=50, lr=0.01, epoch=0)
    assert differing_flags(ours, theirs) == ["--steps 50 (here: 20)", "--lr 0.01 (here: 0.002)"]
    other_layout = dict(ours, layout={"a": 2}, epoch=0)
    assert "the run's layout differs" in differing_flags(ours, other_layout)[0]
    assert differing_flags(ours, dict(other_layout, epoch=1)) == []  # a failover changed it: not compared


def test_a_server_with_another_recipe_names_each_setting_with_both_values():
    from core.protocol.recipe import Recipe

    mine = Recipe(lr=0.002)
    ours = {"model": "tiny", "steps": 20, "lr": 0.002, "recipe": mine.record()}
    run = Recipe(lr=0.002, schedule="cosine", warmup_steps=5, betas=(0.9, 0.99), weight_decay=0.1)
    theirs = dict(ours, recipe=run.record(), epoch=0)
    assert differing_flags(ours, theirs) == [
        "--lr-schedule cosine (here: constant)",
        "--warmup-steps 5 (here: 0)",
        "--betas 0.9,0.99 (here: 0.9,0.95)",
        "--weight-decay 0.1 (here: 0.01)",
    ]
    assert differing_flags(ours, dict(ours, epoch=0)) == []


@pytest.mark.parametrize(
    "problem, words",
    [
        ("protocols not supported: [DialBackService.rpc_dial_back]", "does not serve the dial-back check"),
        ("x7Hq2Ab9 could not dial it: dial tcp 10.0.0.5:31330: connect: connection refused", "nothing listens"),
        ("x7Hq2Ab9 could not dial it: no answer within 10 s", "open its TCP port"),
        ("something else", "open its TCP port"),
    ],
)
def test_the_reachability_advice_fits_what_failed(problem, words):
    assert words in advice_for(problem)


def test_a_fault_in_a_command_is_one_line_with_exit_1(capsys, monkeypatch):
    from peer import cli

    def boom(args):
        raise RuntimeError("the disk is on fire\nsecond line")

    monkeypatch.setattr("peer.plan_cmd.run", boom)
    assert cli.main(["plan", "x", "y"]) == 1
    err = capsys.readouterr().err
    assert err == "peer plan: error: RuntimeError: the disk is on fire\n"


def test_a_command_that_cannot_load_is_one_line_with_exit_1(capsys, monkeypatch, tmp_path):
    """A stale or broken install (a command's module imports what is not there) ends `peer` in one
    line naming what is missing, not a traceback; a command left out of the build is just not listed."""
    from peer import cli

    (tmp_path / "hp_broken_cmd.py").write_text("import hp_not_installed_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "broken", ("hp_broken_cmd", "a command whose module cannot load"))
    assert cli.main(["plan", "--help"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("peer: error: a command cannot load: ModuleNotFoundError") and "hp_not_installed" in err
    assert err.count("\n") == 1
    monkeypatch.setitem(cli.COMMANDS, "broken", ("hp_absent_cmd", "a command not in this build"))
    with pytest.raises(SystemExit):  # --help lists the others and exits 0
        cli.main(["--help"])
    assert "broken" not in capsys.readouterr().out


def test_a_missing_optional_dependency_names_the_extra(capsys, monkeypatch):
    from peer import cli

    def needs_transformers(args):
        raise ModuleNotFoundError("No module named 'transformers'", name="transformers")

    monkeypatch.setattr("peer.export.run", needs_transformers)
    assert cli.main(["export", "ck", "--hf", "out"]) == 2
    assert 'pip install -e ".[hf]"' in capsys.readouterr().err


def test_keygen_makes_the_folder_and_never_overwrites(tmp_path, capsys):
    from peer.cli import main

    key = tmp_path / "a" / "b" / "run.key"
    assert main(["keygen", "-o", str(key)]) == 0 and key.exists()
    assert oct(key.parent.stat().st_mode & 0o777) == "0o700"
    before = key.read_bytes()
    assert main(["keygen", "-o", str(key)]) == 2 and key.read_bytes() == before
    assert "never overwritten" in capsys.readouterr().err


def test_every_help_shows_the_defaults_and_the_presets(capsys):
    from core.model.config import PRESETS
    from peer.cli import main

    for command in ("serve", "join", "swarm"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "(default: " in text or "default: " in text
        if command != "join":
            assert ", ".join(PRESETS) in text and "--steps STEPS default:" in text


def test_a_halt_notice_with_a_state_line_says_each_change_once():
    from peer.directory import HaltNotice

    clock, out = Clock(), io.StringIO()
    line = StateLine("v1", out=out, clock=clock)

    def changed(reason, stopped_for=0.0):
        if reason is not None:
            line.say(PeerState.STOPPED, reason)
        else:
            line.say(PeerState.SERVING, f"the run goes on again after {stopped_for:.0f} s stopped")

    halt = HaltNotice("v1", clock=clock, on_change=changed)
    for _ in range(5):  # read again and again while stopped: said once
        halt.update("run stopped: stage 1 has no backward server (s1b0 gone)")
        clock.t += 2.0
    halt.update(None)
    assert out.getvalue().splitlines() == [
        "v1: stopped: run stopped: stage 1 has no backward server (s1b0 gone)",
        "v1: serving: the run goes on again after 10 s stopped",
    ]
    # a reader whose every read still shows the stop (a stopped server's record stays fresh 3 periods)
    # learns that the run reached its end: it went on, whatever the reads said; and only once
    reader = HaltNotice("v1", clock=clock, clear_after=6.0, on_change=changed)
    reader.update("run stopped: stage 1 has no backward server (s1b0 gone)", progress=2)
    clock.t += 4.0
    reader.update("run stopped: stage 1 has no backward server (s1b0 gone)", progress=6)
    reader.update(None, progress=6)  # no progress past what a stopped read showed, within clear_after
    assert reader.reason is not None
    reader.went_on()
    reader.went_on()
    assert out.getvalue().splitlines()[-2:] == [
        "v1: stopped: run stopped: stage 1 has no backward server (s1b0 gone)",
        "v1: serving: the run goes on again after 4 s stopped",
    ]


def test_a_stopping_server_does_not_wait_for_ever_for_a_task_that_ignores_its_cancellation(tmp_path, caplog):
    """A task that swallows its cancellation (the loops check for that: core.protocol.aio) cannot
    hold a server's stop: it waits TASKS_END_S for its tasks, says how many did not end, and goes."""
    from peer import serve_flags
    from peer.cli import build_parser
    from peer.host import server as host_module
    from peer.host.options import ServerOptions
    from peer.host.server import ServerHost
    from peer.runtime import check_common

    args = build_parser().parse_args(
        ["serve", "--reliable", "--stages", "1", "--stage", "0", "--role", "frontal", "--model", "tiny"]
        + ["--run-key", str(tmp_path / "run.key")]
    )
    check_common(args)
    cfg, layout, device, run_cfg = serve_flags.resolve(args)
    said = io.StringIO()
    host = ServerHost(ServerOptions.from_args(args), cfg, layout, device, run_cfg, out=said)

    async def stubborn(release: asyncio.Event):
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                pass

    async def scenario():
        release = asyncio.Event()
        host.tasks = [asyncio.ensure_future(stubborn(release))]
        await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await host.stop("stopped")
        took = loop.time() - t0
        release.set()
        await asyncio.gather(*host.tasks, return_exceptions=True)
        return took

    host_module.TASKS_END_S, before = 0.3, host_module.TASKS_END_S
    try:
        took = asyncio.run(scenario())
    finally:
        host_module.TASKS_END_S = before
    assert 0.3 <= took < 2.0, took
    assert "1 of its tasks did not end when cancelled" in caplog.text
    assert said.getvalue() == "s0f0: leaving: stopped\n"


def test_a_server_that_reads_other_data_is_refused_naming_both_fingerprints():
    ours = {"model": "tiny", "steps": 20, "lr": 0.002, "data": "aaaa"}
    assert differing_flags(ours, dict(ours, data="bbbb", epoch=0)) == [
        "--data: the run's corpus has fingerprint bbbb (here: aaaa)"
    ]
    # a server that reads no data (a middle stage's) compares nothing
    assert differing_flags(dict(ours, data=None), dict(ours, data="bbbb", epoch=0)) == []


def test_waiting_for_something_says_it_once_treats_a_network_failure_as_waiting_and_stops_when_told():
    """StateLine.wait_for: polls until the check gives a value; says what it waits for once (then once
    a minute); a check that fails on the network is still waiting; bad input is an error at once
    (a run key that does not say which run is a usage error); a stop ends the wait with None."""
    import asyncio

    from core.protocol.trust import AmbiguousRunKey
    from peer.errors import UsageError

    out = io.StringIO()
    line = StateLine("v0", out=out, clock=lambda: 0.0)
    answers = iter([None, ConnectionError("no route"), None, "found"])

    async def check():
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    assert asyncio.run(line.wait_for(asyncio.Event(), "the run", check, poll=0.001)) == "found"
    assert out.getvalue() == "v0: waiting: for the run\n"

    async def ambiguous():
        raise AmbiguousRunKey("two runs named demo: say which with --run-id demo@FINGERPRINT")

    with pytest.raises(UsageError, match="say which"):
        asyncio.run(line.wait_for(asyncio.Event(), "the run", ambiguous, poll=0.001))

    async def stopped():
        stop = asyncio.Event()

        async def never():
            stop.set()
            return None

        return await line.wait_for(stop, "the servers", never, poll=0.001)

    assert asyncio.run(stopped()) is None
