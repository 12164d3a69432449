"""What every test shares: the tiers (markers), chosen by folder so that no test is left without one.

- `unit`: one process, no swarm (tests/taskpool, scheduler, model, protocol, hf, and the docs' checks):
  `python -m pytest -m unit` runs them in about a minute;
- `swarm`: a run's peers (tests/swarm, dashboard): as real processes on 127.0.0.1 where a test needs
  what only a process has (a command's exit code, SIGKILL, SIGSTOP, a supervisor); else as the objects
  `peer serve` and `peer join` run, in one event loop with real DHT nodes (tests/swarm/hosts.py), or
  as stage servers and workers wired without a network (tests/swarm/inprocess.py);
- `net`: real DHT nodes and network namespaces (tests/net; the namespaces need root and skip elsewhere).

Across the tiers, `stress` marks the tests of the riskiest paths (failover, comeback, replicas,
hoarders, checked work, the operator's run, a live identity): scripts/stress.py runs them many times
under CPU load (`--count`, pytest-repeat).

The suite runs on two processes (`-n 2 --dist loadgroup`, pytest-xdist; three on two cores were no
faster than two, and slowed each swarm test 1.5-3x): tests are handed out one by one, the files that
take longest first (`LONGEST_FIRST`), except that the tests that use a file's module- or session-wide
fixture (`TOGETHER`: a swarm started once for the file) stay in one process.

The reference run every equality test compares with is computed once per test run and argument set
(tests/swarm/harness.py `reference_state`)."""

from __future__ import annotations

from pathlib import Path

import pytest

TIERS = {
    "taskpool": "unit",
    "scheduler": "unit",
    "model": "unit",
    "protocol": "unit",
    "hf": "unit",
    "swarm": "swarm",
    "dashboard": "swarm",
    "net": "net",
}


# the files that take a minute or more on a 2-core machine, longest first
LONGEST_FIRST = [
    "swarm/test_faults.py",
    "net/test_deploy_doc.py",
    "swarm/test_hosts.py",
    "swarm/test_lifecycle.py",
    "dashboard/test_live.py",
    "swarm/test_e2e.py",
    "swarm/test_adversary.py",  # (mostly waiting: early, beside the others' compute)
    "swarm/test_inprocess_leases.py",
    "swarm/test_inprocess.py",
    "swarm/test_inprocess_failover.py",
    "swarm/test_inprocess_worker.py",
    "swarm/test_inprocess_assignment.py",
]


# files with a fixture wider than a test, and those fixtures: the tests that use one run in one
# process (the file's other tests go wherever a process is free: the longest of them, the CLI run
# of test_e2e.py, kept its file's whole group on one process); None: the whole file (the dashboard's
# tests without its swarm run before that swarm loads the machine)
TOGETHER: dict[str, set[str] | None] = {
    "dashboard/test_live.py": None,
    "hf/test_hf.py": {"trained"},
    "protocol/test_fuzz.py": {"live"},
    "swarm/test_e2e.py": {"churn_scenario"},
}


def pytest_configure(config):
    config.addinivalue_line("markers", "unit: one process, no swarm (about a minute in all)")
    config.addinivalue_line("markers", "swarm: a swarm of real processes, or the in-process swarm")
    config.addinivalue_line("markers", "net: real DHT nodes and network namespaces")
    config.addinivalue_line(
        "markers", "stress: a risky path's test that scripts/stress.py runs many times under load (docs/stress.md)"
    )


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):

    root = Path(__file__).parent
    for item in items:
        if any(item.get_closest_marker(t) for t in set(TIERS.values())):
            continue  # (a test marked itself: a swarm started from a unit tier's folder)
        rel = Path(str(item.fspath)).relative_to(root)
        tier = TIERS.get(rel.parts[0], "unit") if len(rel.parts) > 1 else "unit"
        item.add_marker(getattr(pytest.mark, tier))
    for item in items:
        rel = Path(str(item.fspath)).relative_to(root).as_posix()
        if rel in TOGETHER and (TOGETHER[rel] is None or TOGETHER[rel] & set(getattr(item, "fixturenames", ()))):
            item.add_marker(pytest.mark.xdist_group(name=rel))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def order(item) -> int:
        return rank.get(Path(str(item.fspath)).relative_to(root).as_posix(), len(rank))

    items.sort(key=order)  # (stable: each file keeps its own order)


def pytest_collection_finish(session):
    """With `--dist loadgroup`, a worker's grouped tests carry their group in their ids (pytest-xdist
    renames them): a pytest that does not let it (9.2 with xdist 3.8) would spread a file's tests,
    and its module-wide swarm with them, over both processes, each starting it again."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [i.nodeid for i in session.items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if lost:
        raise pytest.UsageError(
            f"pytest-xdist did not group {lost[0]} (and {len(lost) - 1} more): see pyproject's pytest pin"
        )
