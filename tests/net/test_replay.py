"""Discovery under a replay, on real DHT nodes: a stranger that copies a live server's signed record and
stores it with a DHT expiry far past its signature (and keeps it in its own storage, as a malicious
node would) cannot hide the stage: the run's nodes refuse the store, and a new reader finds the server
within one announce period, before and after the copy's signature ran out."""

from __future__ import annotations

import asyncio
import time
from functools import partial

from hivemind.dht import DHT
from hivemind.utils import get_dht_time

from core.protocol import record_store
from core.protocol.trust import SigningKey, stage_name
from peer.addresses import visible_maddrs
from peer.node import start_dht, stop_dht

RUN = "replay"
PERIOD = 0.5  # the server's announce period here
TTL = 3.0  # its records' signed life


async def _keep(key: str, subkey: str, value: dict, expiration: float, dht, node) -> None:
    from hivemind.dht.routing import DHTID

    node.protocol.storage.store(
        DHTID.generate(source=key), node.protocol.serializer.dumps(value), expiration, subkey=subkey
    )


def _server_body(now: float) -> dict:
    return {
        "kind": "server",
        "device": "s0f0",
        "role": "frontal",
        "stage": 0,
        "state": "online",
        "version": 0,
        "maddrs": [],
        "time": now,
    }


def test_a_replayed_record_with_a_long_dht_expiry_does_not_hide_the_stage():
    run_key = SigningKey.generate()
    nodes = []
    try:
        boot = start_dht(run_id=RUN, run_fp=run_key.fingerprint)
        nodes.append(boot)
        peers = visible_maddrs(boot)
        server = start_dht(peers, run_id=RUN, run_fp=run_key.fingerprint, run_key=run_key, timeout=30.0)
        nodes.append(server)
        stranger = DHT(initial_peers=peers, start=True, client_mode=False)  # plain hivemind: no validators
        nodes.append(stranger)

        def announce() -> None:
            asyncio.run(
                record_store.publish(server, _server_body(time.time()), TTL, stage=0)
            )  # (False where the stranger holds its copy)

        announce()
        key = stage_name(RUN, 0)
        found = stranger.get(key, latest=True)
        assert found is not None
        subkey, copy = next(iter((str(k), v.value) for k, v in found.value.items()))
        far = get_dht_time() + 900.0
        assert not stranger.store(key, copy, expiration_time=far, subkey=subkey)  # every run node refuses it
        stranger.run_coroutine(partial(_keep, key, subkey, copy, far))

        reader = start_dht(peers, run_id=RUN, run_fp=run_key.fingerprint, client_mode=True, timeout=30.0)
        nodes.append(reader)
        deadline = time.monotonic() + TTL + 3 * PERIOD
        seen_after_expiry = False
        while time.monotonic() < deadline:  # past the copy's signed expiry, the server announcing each period
            announce()
            got = asyncio.run(record_store.read_stage(reader, RUN, 0))
            assert [r["device"] for _, r, _ in got if r is not None] == ["s0f0"], got
            seen_after_expiry = time.time() > copy["expires"] + PERIOD
            time.sleep(PERIOD)
        assert seen_after_expiry
    finally:
        for node in reversed(nodes):
            stop_dht(node)
