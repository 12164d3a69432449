"""Cluster, model and plan files of docs/cost-model.md: parsing, validation, units.

Every error names the field it is about, in the form `cluster.delay_ms.reliable[2]: ...`, and
is a PlanInputError (a ValueError).  Matrices may be given as nested lists (JSON) or as numpy
arrays (the scenario generators hand large clusters over as arrays).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import numpy as np

MBPS = 1e6 / 8  # bytes/s per Mb/s


class PlanInputError(ValueError):
    """A cluster, model or plan file that does not follow the spec; the message names the field."""


def _read(path_or_dict, what: str) -> dict:
    if isinstance(path_or_dict, dict):
        return path_or_dict
    if isinstance(path_or_dict, (str, os.PathLike)):
        try:
            with open(path_or_dict) as f:
                data = json.load(f)
        except OSError as e:
            raise PlanInputError(f"{what}: cannot read {os.fspath(path_or_dict)!r}: {e.strerror}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlanInputError(f"{what}: {os.fspath(path_or_dict)!r} is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise PlanInputError(f"{what}: expected a JSON object, got {type(data).__name__}")
        return data
    raise PlanInputError(f"{what}: expected a file path or a dict, got {type(path_or_dict).__name__}")


def _number(value, name: str, *, positive=False, nonneg=False, integer=False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise PlanInputError(f"{name}: expected a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise PlanInputError(f"{name}: expected a finite number, got {value!r}")
    if integer and v != int(v):
        raise PlanInputError(f"{name}: expected an integer, got {value!r}")
    if positive and v <= 0:
        raise PlanInputError(f"{name}: must be positive, got {value!r}")
    if nonneg and v < 0:
        raise PlanInputError(f"{name}: must not be negative, got {value!r}")
    return v


def _check_keys(obj: dict, name: str, allowed: set, required: set) -> None:
    for key in required:
        if key not in obj:
            raise PlanInputError(f"{name}.{key}: missing")
    for key in obj:
        if key not in allowed:
            raise PlanInputError(f"{name}.{key}: unknown field (expected one of {', '.join(sorted(allowed))})")


def _matrix(value, name: str, rows: int, cols: int, *, diagonal_ignored=False, positive=False) -> np.ndarray:
    """A rows x cols matrix of finite non-negative numbers (positive where `positive`)."""
    if isinstance(value, np.ndarray):
        arr = np.asarray(value, dtype=float)
        if arr.ndim != 2 or arr.shape != (rows, cols):
            raise PlanInputError(f"{name}: expected a {rows}x{cols} matrix, got shape {arr.shape}")
    else:
        if not isinstance(value, list):
            raise PlanInputError(f"{name}: expected a list of {rows} rows, got {type(value).__name__}")
        if len(value) != rows:
            raise PlanInputError(f"{name}: expected {rows} rows, got {len(value)}")
        for i, row in enumerate(value):
            if not isinstance(row, (list, np.ndarray)):
                raise PlanInputError(f"{name}[{i}]: expected a list of {cols} values, got {type(row).__name__}")
            if len(row) != cols:
                raise PlanInputError(f"{name}[{i}]: expected {cols} values, got {len(row)}")
            for j, x in enumerate(row):
                if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
                    raise PlanInputError(f"{name}[{i}][{j}]: expected a number, got {x!r}")
        arr = np.array(value, dtype=float).reshape(rows, cols)
    mask = np.ones(arr.shape, dtype=bool)
    if diagonal_ignored:
        np.fill_diagonal(mask, False)
    bad = mask & ~np.isfinite(arr)
    if not bad.any():
        bad = mask & ((arr <= 0) if positive else (arr < 0))
    if bad.any():
        i, j = (int(x) for x in np.argwhere(bad)[0])
        what = "positive" if positive else "finite and not negative"
        raise PlanInputError(
            f"{name}[{i}][{j}]: must be {what}, got {value[i][j] if isinstance(value, list) else arr[i, j]!r}"
        )
    return arr


@dataclass
class Cluster:
    """Devices and links, in code units (FLOP/s, seconds, bytes/s, bytes)."""

    reliable_ids: list
    unreliable_ids: list
    reliable_flops: np.ndarray
    unreliable_flops: np.ndarray
    reliable_memory: list  # bytes or None per reliable device
    unreliable_memory: list  # bytes or None per unreliable device
    delay_rr: np.ndarray  # R x R, from i to j
    bw_rr: np.ndarray  # R x R
    delay_ur: np.ndarray  # U x R, both ways
    bw_ur: np.ndarray  # U x R
    _index: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self._index = {d: ("r", i) for i, d in enumerate(self.reliable_ids)}
        self._index.update({d: ("u", i) for i, d in enumerate(self.unreliable_ids)})

    @property
    def n_reliable(self) -> int:
        return len(self.reliable_ids)

    @property
    def n_unreliable(self) -> int:
        return len(self.unreliable_ids)

    def kind(self, device_id: str) -> str:
        """'reliable' or 'unreliable'; KeyError for an unknown id."""
        return "reliable" if self._index[device_id][0] == "r" else "unreliable"

    def index(self, device_id: str) -> int:
        return self._index[device_id][1]

    def _pair(self, x: str, y: str):
        (kx, ix), (ky, iy) = self._index[x], self._index[y]
        if kx == "u" and ky == "u":
            raise ValueError(f"unreliable devices {x} and {y} never talk to each other")
        return kx, ix, ky, iy

    def delay(self, x: str, y: str) -> float:
        """One-way delay from x to y in seconds (0 from a device to itself)."""
        if x == y:
            return 0.0
        kx, ix, ky, iy = self._pair(x, y)
        if kx == "r" and ky == "r":
            return float(self.delay_rr[ix, iy])
        return float(self.delay_ur[ix, iy] if kx == "u" else self.delay_ur[iy, ix])

    def bandwidth(self, x: str, y: str) -> float:
        """Bandwidth from x to y in bytes/s (infinite from a device to itself)."""
        if x == y:
            return math.inf
        kx, ix, ky, iy = self._pair(x, y)
        if kx == "r" and ky == "r":
            return float(self.bw_rr[ix, iy])
        return float(self.bw_ur[ix, iy] if kx == "u" else self.bw_ur[iy, ix])


_CLUSTER_KEYS = {"reliable", "unreliable", "delay_ms", "bandwidth_mbps", "name", "description", "meta"}
_DEVICE_KEYS = {"id", "tflops", "memory_gb"}


def _devices(value, name: str, seen: dict):
    if not isinstance(value, list):
        raise PlanInputError(f"{name}: expected a list of devices, got {type(value).__name__}")
    ids, flops, memory = [], [], []
    for i, dev in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(dev, dict):
            raise PlanInputError(f"{where}: expected an object with id and tflops, got {type(dev).__name__}")
        _check_keys(dev, where, _DEVICE_KEYS, {"id", "tflops"})
        did = dev["id"]
        if not isinstance(did, str) or not did:
            raise PlanInputError(f"{where}.id: expected a non-empty string, got {did!r}")
        if did in seen:
            raise PlanInputError(f"{where}.id: duplicate id {did!r} (also {seen[did]})")
        seen[did] = where
        ids.append(did)
        flops.append(_number(dev["tflops"], f"{where}.tflops", positive=True) * 1e12)
        mem = dev.get("memory_gb")
        memory.append(None if mem is None else _number(mem, f"{where}.memory_gb", positive=True) * 1e9)
    return ids, np.array(flops, dtype=float), memory


def load_cluster(path_or_dict) -> Cluster:
    """Read and check a cluster file (path or dict) and convert it to code units."""
    data = _read(path_or_dict, "cluster")
    _check_keys(data, "cluster", _CLUSTER_KEYS, {"reliable", "delay_ms", "bandwidth_mbps"})
    seen: dict = {}
    rids, rflops, rmem = _devices(data["reliable"], "cluster.reliable", seen)
    uids, uflops, umem = _devices(data.get("unreliable", []), "cluster.unreliable", seen)
    if len(rids) < 2:
        raise PlanInputError(
            f"cluster.reliable: at least 2 reliable devices are needed (one frontal and one backward server), got {len(rids)}"
        )
    R, U = len(rids), len(uids)
    mats = {}
    for key, positive in (("delay_ms", False), ("bandwidth_mbps", True)):
        block = data[key]
        if not isinstance(block, dict):
            raise PlanInputError(
                f"cluster.{key}: expected an object with 'reliable' and 'unreliable', got {type(block).__name__}"
            )
        _check_keys(
            block, f"cluster.{key}", {"reliable", "unreliable"}, {"reliable"} | ({"unreliable"} if U else set())
        )
        rr = _matrix(block["reliable"], f"cluster.{key}.reliable", R, R, diagonal_ignored=True, positive=positive)
        if U == 0 and ("unreliable" not in block or _empty(block["unreliable"])):
            ur = np.zeros((0, R))
        else:
            ur = _matrix(block["unreliable"], f"cluster.{key}.unreliable", U, R, positive=positive)
        mats[key] = (rr, ur)
    delay_rr = mats["delay_ms"][0] / 1e3
    delay_ur = mats["delay_ms"][1] / 1e3
    bw_rr = mats["bandwidth_mbps"][0] * MBPS
    bw_ur = mats["bandwidth_mbps"][1] * MBPS
    np.fill_diagonal(delay_rr, 0.0)
    np.fill_diagonal(bw_rr, np.inf)
    return Cluster(rids, uids, rflops, uflops, rmem, umem, delay_rr, bw_rr, delay_ur, bw_ur)


def _empty(value) -> bool:
    return (isinstance(value, list) and len(value) == 0) or (isinstance(value, np.ndarray) and value.size == 0)


@dataclass(frozen=True)
class ModelSpec:
    layers: int
    hidden: int
    bytes_per_value: int
    batch_tokens: int
    micro_batches: int
    flops_per_token_per_layer: float

    @property
    def params_per_layer(self) -> float:
        return 12.0 * self.hidden**2

    @property
    def act_bytes_per_token(self) -> float:
        return float(self.hidden * self.bytes_per_value)

    @property
    def tokens_per_micro_batch(self) -> float:
        return self.batch_tokens / self.micro_batches


def load_model(path_or_dict) -> ModelSpec:
    data = _read(path_or_dict, "model")
    keys = {"layers", "hidden", "bytes_per_value", "batch_tokens", "micro_batches"}
    _check_keys(data, "model", keys | {"flops_per_token_per_layer", "name", "description", "meta"}, keys)
    vals = {k: int(_number(data[k], f"model.{k}", positive=True, integer=True)) for k in sorted(keys)}
    if vals["micro_batches"] > vals["batch_tokens"]:
        raise PlanInputError(
            f"model.micro_batches: {vals['micro_batches']} micro-batches of a batch of "
            f"{vals['batch_tokens']} tokens leaves some empty"
        )
    flops = data.get("flops_per_token_per_layer")
    flops = (
        72.0 * vals["hidden"] ** 2
        if flops is None
        else _number(flops, "model.flops_per_token_per_layer", positive=True)
    )
    return ModelSpec(flops_per_token_per_layer=flops, **vals)


@dataclass
class Stage:
    frontal: list
    backward: list
    clients: list
    layers: tuple

    def to_dict(self) -> dict:
        return {
            "frontal": list(self.frontal),
            "backward": list(self.backward),
            "clients": list(self.clients),
            "layers": [int(self.layers[0]), int(self.layers[1])],
        }


@dataclass
class Plan:
    stages: list
    idle: list = field(default_factory=list)
    predicted_seconds_per_batch: float | None = None

    def to_dict(self) -> dict:
        d = {"stages": [s.to_dict() for s in self.stages], "idle": list(self.idle)}
        if self.predicted_seconds_per_batch is not None:
            p = self.predicted_seconds_per_batch
            d["predicted_seconds_per_batch"] = p if math.isfinite(p) else None
        return d

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")


def _id_list(value, name: str, cluster: Cluster | None) -> list:
    if not isinstance(value, list):
        raise PlanInputError(f"{name}: expected a list of device ids, got {type(value).__name__}")
    for i, d in enumerate(value):
        if not isinstance(d, str):
            raise PlanInputError(f"{name}[{i}]: expected a device id string, got {d!r}")
        if cluster is not None and d not in cluster._index:
            raise PlanInputError(f"{name}[{i}]: unknown device {d!r}")
    return list(value)


def load_plan(path_or_dict, cluster: Cluster | None = None) -> Plan:
    """Read a plan file; checks its shape and that every id is in `cluster`. Whether the plan
    follows the rules (every device placed once, layers tiling the model, memory) is for
    plan_cost, which gives the reason."""
    data = _read(path_or_dict, "plan")
    _check_keys(data, "plan", {"stages", "idle", "predicted_seconds_per_batch", "algorithm", "meta"}, {"stages"})
    stages = data["stages"]
    if not isinstance(stages, list) or not stages:
        raise PlanInputError("plan.stages: expected a non-empty list of stages")
    out = []
    for k, st in enumerate(stages):
        where = f"plan.stages[{k}]"
        if not isinstance(st, dict):
            raise PlanInputError(f"{where}: expected an object, got {type(st).__name__}")
        _check_keys(st, where, {"frontal", "backward", "clients", "layers"}, {"frontal", "backward", "layers"})
        layers = st["layers"]
        if (
            not isinstance(layers, list)
            or len(layers) != 2
            or any(isinstance(x, bool) or not isinstance(x, int) for x in layers)
        ):
            raise PlanInputError(f"{where}.layers: expected [first, end) as two integers, got {layers!r}")
        out.append(
            Stage(
                _id_list(st["frontal"], f"{where}.frontal", cluster),
                _id_list(st["backward"], f"{where}.backward", cluster),
                _id_list(st.get("clients", []), f"{where}.clients", cluster),
                (layers[0], layers[1]),
            )
        )
    idle = _id_list(data.get("idle", []), "plan.idle", cluster)
    pred = data.get("predicted_seconds_per_batch")
    if pred is not None:
        pred = _number(pred, "plan.predicted_seconds_per_batch", nonneg=True)
    return Plan(out, idle, pred)
