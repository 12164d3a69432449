"""The run's status dashboard, read from the DHT records alone (docs/dashboard.md): per stage its
layers, servers, volunteers, task pools and tokens/s; the run's step, loss, throughput and seconds
per step; and what blocks it.

Rooms: snapshot.py (the pure model of a run) and entries.py (what it makes of each record, and the
History kept between snapshots), reader.py (the DHT, the polling Watcher, merging several reads),
terminal.py (rich view), web.py (page, /api/state) with static/index.html, metrics.py (Prometheus
through prometheus_client), cli.py (the command line of scripts/dashboard.py)."""

from peer.dashboard.cli import main

__all__ = ["main"]
