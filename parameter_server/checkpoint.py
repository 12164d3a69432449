"""A server's checkpoint: its parameter shard, AdamW state, version and counters in ONE file,
replaced atomically after every step (a SIGKILL between two files would pair new parameters with an
old version and optimizer state, and a replay would apply a step twice). The request log beside it
(parameter_server/requestlog.py) carries what happened since."""
from __future__ import annotations

import json
import os

import torch


def _path(directory: str, device: str) -> str:
    return os.path.join(directory, f"{device}.shard.pt")


def save_checkpoint(server, directory: str) -> None:
    path = _path(directory, server.device_id)
    tmp = path + ".tmp"
    torch.save(server.shard.state_dict(), tmp)
    os.replace(tmp, path)
    with open(os.path.join(directory, f"{server.device_id}.json"), "w") as f:  # for people and the dashboard
        json.dump({"version": server.shard.version, "device": server.device_id, "stage": server.stage}, f)


def load_checkpoint(server, directory: str) -> bool:
    path = _path(directory, server.device_id)
    if not os.path.exists(path):
        return False
    state = torch.load(path, weights_only=False)
    missing = set(server.shard.names) - set(state["params"])
    if missing:
        raise ValueError(f"checkpoint {path} lacks {sorted(missing)[:3]}: not this server's shard")
    server.shard.load_state_dict(state)
    server.next_batch = server.shard.version
    return True
