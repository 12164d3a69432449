"""What every test shares: the tiers (markers), chosen by folder so that no test is left without one.

- `unit`: one process, no swarm (tests/taskpool, scheduler, model, protocol, hf, and the docs' checks):
  `python -m pytest -m unit` runs them in about a minute;
- `swarm`: real swarms of processes on 127.0.0.1, or the in-process swarm (tests/swarm, dashboard);
- `net`: real DHT nodes and network namespaces (tests/net; the namespaces need root and skip elsewhere).

The reference run every equality test compares with is computed once per test run and argument set
(tests/swarm/harness.py `reference_state`)."""

from __future__ import annotations

from pathlib import Path

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


def pytest_configure(config):
    config.addinivalue_line("markers", "unit: one process, no swarm (about a minute in all)")
    config.addinivalue_line("markers", "swarm: a swarm of real processes, or the in-process swarm")
    config.addinivalue_line("markers", "net: real DHT nodes and network namespaces")


def pytest_collection_modifyitems(config, items):
    import pytest

    root = Path(__file__).parent
    for item in items:
        if any(item.get_closest_marker(t) for t in set(TIERS.values())):
            continue  # (a test marked itself: a swarm started from a unit tier's folder)
        rel = Path(str(item.fspath)).relative_to(root)
        tier = TIERS.get(rel.parts[0], "unit") if len(rel.parts) > 1 else "unit"
        item.add_marker(getattr(pytest.mark, tier))
