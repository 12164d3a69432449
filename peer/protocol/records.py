"""DHT records: keys, schemas and validation. Every key starts with the run id, so several runs
share one DHT. Like Petals' module records: a key per stage, a subkey per peer id, a value with
role, state, load and version, re-announced on a period and expiring by itself."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass
from typing import Any

from hivemind.utils import get_dht_time

logger = logging.getLogger("hivepipe.records")

STATES = ("online", "joining", "offline")
ROLES = ("frontal", "backward")


def config_key(run_id: str) -> str:
    return f"{run_id}.config"


def stage_key(run_id: str, stage: int) -> str:
    return f"{run_id}.stage{stage}"


@dataclass(frozen=True)
class RunConfig:
    """What every peer of a run must agree on; servers publish it, volunteers read it."""
    run_id: str
    model: str
    seed: int
    steps: int
    batch_size: int
    micro_batches: int
    lr: float
    layout: dict  # RunLayout.to_dict()
    announce_period: float = 1.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> "RunConfig":
        if not isinstance(d, dict):
            raise ValueError("run config record: expected a map")
        kinds = {"run_id": str, "model": str, "seed": int, "steps": int, "batch_size": int,
                 "micro_batches": int, "lr": (int, float), "layout": dict, "announce_period": (int, float)}
        for k, kind in kinds.items():
            if k not in d:
                raise ValueError(f"run config record: missing field {k!r}")
            if not isinstance(d[k], kind) or isinstance(d[k], bool):
                raise ValueError(f"run config record: field {k!r} has the wrong type {type(d[k]).__name__}")
        return cls(**{k: d[k] for k in kinds})


# name -> (types, required) for the two kinds of stage records
_SERVER_SCHEMA = {"kind": (str, True), "device": (str, True), "role": (str, True), "stage": (int, True),
                  "state": (str, True), "version": (int, True), "maddrs": (list, True), "pool": (dict, False),
                  "loss": ((int, float, type(None)), False), "losses": (dict, False), "stats": (dict, False),
                  "layers": (list, False), "compute": ((int, float), False), "step_times": (dict, False),
                  "epoch": (int, False),
                  "time": ((int, float), True)}
_CLIENT_SCHEMA = {"kind": (str, True), "device": (str, True), "stage": (int, True), "state": (str, True),
                  "compute": ((int, float), True), "throughput": ((int, float), False), "tasks_done": (int, False),
                  "time": ((int, float), True)}


def validate_record(value: Any) -> dict:
    """Return the record if it fits its schema, else raise ValueError saying what does not fit."""
    if not isinstance(value, dict):
        raise ValueError(f"expected a map, got {type(value).__name__}")
    kind = value.get("kind")
    schema = {"server": _SERVER_SCHEMA, "client": _CLIENT_SCHEMA}.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise ValueError(f"unknown record kind {kind!r}")
    for name, (types, required) in schema.items():
        if name not in value:
            if required:
                raise ValueError(f"{kind} record: missing field {name!r}")
            continue
        if not isinstance(value[name], types) or (isinstance(value[name], bool) and types is not bool):
            raise ValueError(f"{kind} record: field {name!r} has the wrong type {type(value[name]).__name__}")
    if value["state"] not in STATES:
        raise ValueError(f"{kind} record: state {value['state']!r} not one of {STATES}")
    if kind == "server" and value["role"] not in ROLES:
        raise ValueError(f"server record: role {value['role']!r} not one of {ROLES}")
    return value


async def store(dht, key: str, value: Any, ttl: float, subkey: str | None = None) -> bool:
    return await dht.store(key, value, expiration_time=get_dht_time() + ttl, subkey=subkey, return_future=True)


async def get(dht, key: str) -> Any:
    found = await dht.get(key, latest=True, return_future=True)
    return None if found is None else found.value


def subkey_values(value: dict) -> dict[str, Any]:
    """{subkey (a peer id): raw value} of a key stored with subkeys (hivemind wraps each value)."""
    return {str(k): getattr(v, "value", v) for k, v in value.items()}


async def read_stage(dht, run_id: str, stage: int) -> list[tuple[str, dict | None, str | None]]:
    """All records under a stage key as (peer id, record or None, problem or None)."""
    value = await get(dht, stage_key(run_id, stage))
    out = []
    if isinstance(value, dict):
        for subkey, raw in subkey_values(value).items():
            try:
                out.append((subkey, validate_record(raw), None))
            except ValueError as e:
                out.append((subkey, None, str(e)))
    return out


async def read_config(dht, run_id: str, timeout: float = 60.0, poll: float = 0.25) -> RunConfig:
    """Wait for the run's config record (published by its servers)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await get(dht, config_key(run_id))
        if value is not None:
            return RunConfig.from_dict(value)
        if loop.time() > deadline:
            raise TimeoutError(f"no run {run_id!r} found in the DHT after {timeout:.0f} s")
        await asyncio.sleep(poll)
