"""A server's checkpoint: its parameter shard (safetensors, readable by anyone) and its optimizer
state and counters (torch.save), written atomically after every step."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file


def _paths(directory: str, device: str) -> tuple[str, str, str]:
    base = os.path.join(directory, device)
    return base + ".params.safetensors", base + ".state.pt", base + ".json"


def save_checkpoint(server, directory: str) -> None:
    params_path, state_path, meta_path = _paths(directory, server.device_id)
    state = server.shard.state_dict()
    params = {n: t.contiguous() for n, t in state.pop("params").items()}
    for path, write in ((params_path, lambda p: save_file(params, p)), (state_path, lambda p: torch.save(state, p)),
                        (meta_path, lambda p: open(p, "w").write(json.dumps(
                            {"version": state["version"], "device": server.device_id, "stage": server.stage})))):
        tmp = path + ".tmp"
        write(tmp)
        os.replace(tmp, path)


def load_checkpoint(server, directory: str) -> bool:
    params_path, state_path, _ = _paths(directory, server.device_id)
    if not (os.path.exists(params_path) and os.path.exists(state_path)):
        return False
    state = torch.load(state_path, weights_only=False)
    state["params"] = load_file(params_path)
    missing = set(server.shard.names) - set(state["params"])
    if missing:
        raise ValueError(f"checkpoint {params_path} lacks {sorted(missing)[:3]}...")
    server.shard.load_state_dict(state)
    server.next_batch = server.shard.version + (1 if server.shard.version else 0)
    return True
