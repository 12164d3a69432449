"""Records in the DHT: each process's own record signed and stored (`publish`), the run's config and
a stage's records read and opened (each verified against the run's trust, core/protocol/trust.py),
and what the validators refused. What a record holds, its keys and its life are core/protocol/records.py."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from core.protocol.records import RunConfig, config_key
from core.protocol.trust import key_name

logger = logging.getLogger("hivepipe.records")


@dataclass
class Trust:
    """What a process knows to write and read its run's records (core.protocol.trust): the run, the
    fingerprint of the run key it trusts (None until a reader without one has found the run's),
    its own identity key (signs its records), and the run key itself on a server."""

    run_id: str
    run_fp: str | None
    identity: Any  # trust.SigningKey
    run_key: Any = None  # trust.SigningKey on the run's servers


def trust_of(dht) -> Trust:
    trust = getattr(dht, "hivepipe_trust", None)
    if trust is None:
        raise RuntimeError("this DHT node was started without the run's trust (peer.node.start_dht)")
    return trust


async def publish(dht, body: dict, ttl: float, stage: int | None = None) -> bool:
    """Sign and store this process's record: the run's config (stage None; needs the run key) or its
    own record under its stage's key, a server's under the servers' key and a volunteer's under the
    volunteers' (subkey: its peer id)."""
    from core.protocol.trust import seal

    trust = trust_of(dht)
    if stage is None:
        if trust.run_key is None:
            raise RuntimeError("only a holder of the run key writes the run's config")
        name, subkey, run_key = config_key(trust.run_id), trust.run_key.fingerprint, None
        signer = trust.run_key
    else:
        server = body.get("kind") == "server"
        name = key_name(trust.run_id, "stage" if server else "clients", stage)
        subkey, signer, run_key = str(dht.peer_id), trust.identity, trust.run_key if server else None
    value = seal(name, subkey, body, ttl, signer, run_key=run_key)
    return await dht.store(name, value, expiration_time=value["expires"], subkey=subkey, return_future=True)


async def get(dht, key: str) -> Any:
    found = await dht.get(key, latest=True, return_future=True)
    return None if found is None else found.value


def subkey_values(value: dict) -> dict[str, Any]:
    """{subkey (a peer id): raw value} of a key stored with subkeys (hivemind wraps each value)."""
    return {str(k): getattr(v, "value", v) for k, v in value.items()}


def open_config(trust: Trust, raw: Any) -> tuple[dict | None, list[tuple[str, str]]]:
    """The run's config among the values under its config key (a map fingerprint -> envelope), and
    [(subkey, why dropped)] of the others. A reader without a fingerprint takes the run key of the
    only config that verifies (and keeps it); with several it cannot choose: ValueError."""
    from core.protocol.trust import AmbiguousRunKey, Expired, TrustError, open_record

    bodies, dropped = {}, []
    for subkey, value in (subkey_values(raw) if isinstance(raw, dict) else {}).items():
        try:
            bodies[subkey] = open_record(trust.run_id, "config", None, subkey, value, trust.run_fp)
        except Expired:
            continue  # at its end of life (a replay is counted by the DHT node's validator)
        except TrustError as e:
            dropped.append((subkey, str(e)))
    if trust.run_fp is None and bodies:
        if len(bodies) > 1:
            raise AmbiguousRunKey(
                f"run {trust.run_id!r} is published under {len(bodies)} run keys ({', '.join(sorted(bodies))}): "
                f"say which with --run-id {trust.run_id}@FINGERPRINT (the fingerprint its first server "
                "printed)"
            )
        trust.run_fp = next(iter(bodies))
        logger.warning(
            "trusting run key %s for run %r, the only one that publishes it (pass --run-id %s@%s to be sure)",
            trust.run_fp,
            trust.run_id,
            trust.run_id,
            trust.run_fp,
        )
    return bodies.get(trust.run_fp), dropped


async def read_config_value(dht) -> dict | None:
    """The run's config record (a map) as its run key signed it, or None while there is none."""
    trust = trust_of(dht)
    config, _ = open_config(trust, await get(dht, config_key(trust.run_id)))
    return config


def open_stage(trust: Trust, stage: int, raw: Any, kind: str = "stage") -> list[tuple[str, dict | None, str | None]]:
    """The records under a stage's servers' key (`kind` "stage") or its volunteers' ("clients") as
    (peer id, record or None, why it was dropped or None)."""
    from core.protocol.trust import Expired, TrustError, open_record

    out = []
    for subkey, value in (subkey_values(raw) if isinstance(raw, dict) else {}).items():
        try:
            out.append((subkey, open_record(trust.run_id, kind, stage, subkey, value, trust.run_fp), None))
        except Expired:
            continue  # at its end of life (a replay is counted by the DHT node's validator)
        except TrustError as e:
            out.append((subkey, None, str(e)))
    return out


async def _latest_of_each(_dht, node, keys: tuple[str, ...]) -> dict[str, Any]:
    """(Runs in the DHT process.) The latest value of every key in `keys`, found by one traversal of
    the DHT for all of them."""
    found = await node.get_many(keys, sufficient_expiration_time=float("inf"))
    return {k: None if v is None else v.value for k, v in found.items()}


async def read_stages(
    dht, run_id: str, num_stages: int, kind: str = "stage"
) -> list[list[tuple[str, dict | None, str | None]]]:
    """read_stage of stages 0..num_stages-1, in one DHT traversal rather than one per stage (each
    server and volunteer reads every stage's servers each announce period: most of an idle swarm's
    DHT calls). `kind` "clients": the stages' volunteers' records instead (the dashboard's read)."""
    import functools

    trust = trust_of(dht)
    assert run_id == trust.run_id, (run_id, trust.run_id)
    keys = tuple(key_name(run_id, kind, k) for k in range(num_stages))
    raw = await dht.run_coroutine(functools.partial(_latest_of_each, keys=keys), return_future=True)
    return [open_stage(trust, k, raw.get(key), kind) for k, key in enumerate(keys)]


async def read_stage(dht, run_id: str, stage: int, kind: str = "stage") -> list[tuple[str, dict | None, str | None]]:
    """All records under a stage's servers' key (`kind` "clients": its volunteers') as (peer id,
    record or None, problem or None): a record counts only if its peer signed it (and, for a
    server, the run key)."""
    trust = trust_of(dht)
    assert run_id == trust.run_id, (run_id, trust.run_id)
    key = key_name(run_id, kind, stage)
    return open_stage(trust, stage, await get(dht, key), kind)


async def read_config(dht, run_id: str) -> RunConfig | None:
    """The run's config record (published by its servers), or None while there is none; ValueError
    when it does not fit the schema. Callers that wait poll it (peer/join.py's wait_until)."""
    value = await read_config_value(dht)
    return None if value is None else RunConfig.from_dict(value)


async def validator_rejections(_dht, node) -> list[dict]:
    """(Run in the DHT process: dht.run_coroutine.) The records its run validator dropped, latest last."""
    from dataclasses import asdict

    from core.protocol.validator import RunValidator

    for v in getattr(node.protocol.record_validator, "_validators", []):
        if isinstance(v, RunValidator):
            return [asdict(r) for r in v.rejected]
    return []


async def other_run_keys(dht) -> list[str]:
    """The fingerprints of the other run keys this node saw publish a config under its run's name
    (its validator dropped them): a run that exists, but under another key than the one trusted here."""
    import re

    trust = trust_of(dht)
    found = []
    for r in await dht.run_coroutine(validator_rejections, return_future=True):
        m = re.match(r"config of another run key \((\S+),", r["reason"])
        if r["key"] == config_key(trust.run_id) and m and m.group(1) not in found:
            found.append(m.group(1))
    return found
