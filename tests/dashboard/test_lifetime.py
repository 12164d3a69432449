"""A dashboard started with --parent-pid leaves, with its DHT process and p2p daemon, when the process
that started it is SIGKILLed alone (real processes, real SIGKILL): a killed launcher or test run
leaves no dashboard serving."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from tests.net.test_node_lifetime import descendants, survivors

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STARTER = textwrap.dedent("""
    import os, signal, subprocess, sys
    from peer.node import start_dht
    from peer.addresses import visible_maddrs

    dht = start_dht(run_id="dash-lifetime", run_fp=None)
    dash = subprocess.Popen(
        [sys.executable, "scripts/dashboard.py", "--initial-peers", *visible_maddrs(dht), "--run-id",
         "dash-lifetime", "--serve", "0", "--parent-pid", str(os.getpid())],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    print(dash.pid, flush=True)
    print(dash.stdout.readline().strip(), flush=True)  # its address: it joined the DHT and serves
    signal.pause()  # until the test kills it
""")


def test_a_dashboard_leaves_with_the_process_that_started_it():
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER], stdout=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True
    )
    dash = None
    try:
        dash = int(starter.stdout.readline())
        assert starter.stdout.readline().startswith("serving on http://127.0.0.1:")
        group = [dash] + descendants(dash)
        assert len(group) >= 3, group  # the dashboard, its DHT process and p2p daemon
        os.kill(starter.pid, signal.SIGKILL)  # the starter alone, as an OOM kill would
        starter.wait()
        assert not survivors(group), "the dashboard or its DHT outlived the process that started it"
    finally:
        for pgid in [starter.pid] + ([dash] if dash else []):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
