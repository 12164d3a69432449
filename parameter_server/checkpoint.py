"""A server's checkpoint: its version, counters and the names of its kept versions' files (each
version's parameters and AdamW state, the current one's among them) in ONE file, replaced atomically
after every step once the new version's file is on disk (a SIGKILL between two files would pair new
parameters with an old version and optimizer state, and a replay would apply a step twice). The
request log beside it (parameter_server/requestlog.py) carries what happened since."""

from __future__ import annotations

import json
import logging
import os

from parameter_server import blob

logger = logging.getLogger("hivepipe.server")


def _path(directory: str, device: str) -> str:
    return os.path.join(directory, f"{device}.shard.pt")


def checkpoint_state(server) -> tuple[dict, dict]:
    """What a checkpoint holds, copied now (ShardState.state_dict copies what a step changes in
    place): every shard slot the server hosts (its own and, after a failover, the slots it took
    over), and the summary beside it for people and the dashboard."""
    state = {"own_slot": server.slot, "slots": {slot: sh.state_dict() for slot, sh in server.hosted.items()}}
    summary = {
        "version": server.version,
        "device": server.device_id,
        "stage": server.stage,
        "slots": sorted(server.hosted),
        "epoch": server.epoch,
    }
    return state, summary


def _history_out(directory: str, prefix: str, shard: dict) -> dict:
    """A shard's state with its kept versions (parameter snapshot and AdamW moments of each) moved to
    files of their own, `{prefix}.{token}.pt`, each written once: a version never changes under its
    token, so a step writes only the version it made, not every kept one again (the whole window,
    3 + 2 x stages versions of 3 tensors each, was ~24 copies of the shard per step and server)."""
    shard = dict(shard)
    snapshots, moments, tokens = shard.pop("snapshots"), shard.pop("moments"), shard.pop("tokens")
    history = {}
    for v, snap in snapshots.items():
        name = f"{prefix}.{tokens[v]}.pt"
        if not os.path.exists(os.path.join(directory, name)):
            blob.save({"snapshot": snap, "moments": moments.get(v)}, os.path.join(directory, name))
        history[v] = name
    shard["history"], shard["tokens"] = history, tokens
    return shard


def _history_in(directory: str, shard: dict) -> dict:
    """The inverse of _history_out (a state written before it, with the versions inline, as it is)."""
    if "history" not in shard:
        return shard
    shard = dict(shard)
    shard["snapshots"], shard["moments"] = {}, {}
    for v, name in shard.pop("history").items():
        saved = blob.load(os.path.join(directory, name))
        shard["snapshots"][v] = saved["snapshot"]
        if saved["moments"] is not None:
            shard["moments"][v] = saved["moments"]
    return shard


def _current_params(directory: str, shard: dict) -> dict:
    """The parameters of the version a saved shard state is at: that version's kept snapshot (read
    from its own file if the history is not read in yet), or inline beside the history in a state
    written before ShardState took them from it."""
    if "params" in shard:
        return shard["params"]
    if "history" in shard:
        name = shard["history"].get(shard["version"])
        return {} if name is None else blob.load(os.path.join(directory, name))["snapshot"]
    return shard["snapshots"].get(shard["version"], {})


def _forget_history(directory: str, prefix: str, keep: set[str]) -> None:
    """Delete the version files under `prefix` that the file just written no longer names."""
    for name in os.listdir(directory):
        if name.startswith(prefix + ".") and name.endswith(".pt") and name not in keep:
            try:
                os.remove(os.path.join(directory, name))
            except FileNotFoundError:
                pass


def write_checkpoint(directory: str, device: str, state: dict, summary: dict) -> None:
    prefix = f"{device}.history"
    state = dict(
        state, slots={slot: _history_out(directory, f"{prefix}.s{slot}", sh) for slot, sh in state["slots"].items()}
    )
    blob.save(state, _path(directory, device))
    _forget_history(directory, prefix, {name for sh in state["slots"].values() for name in sh["history"].values()})
    with open(os.path.join(directory, f"{device}.json"), "w") as f:
        json.dump(summary, f)


def save_checkpoint(server, directory: str) -> None:
    write_checkpoint(directory, server.device_id, *checkpoint_state(server))


def _replica_path(directory: str, device: str, slot: int) -> str:
    return os.path.join(directory, f"{device}.replica{slot}.pt")


def write_replica(directory: str, device: str, slot: int, state: dict) -> None:
    """The replica of another server's slot, as it arrives: the state a takeover starts from must
    outlive a crash of this server (a crash right after adopting a slot, before its first step
    there, lost the slot when replicas lived only in memory)."""
    prefix = f"{device}.replica{slot}.history"
    state = _history_out(directory, prefix, state)
    blob.save(state, _replica_path(directory, device, slot))
    _forget_history(directory, prefix, set(state["history"].values()))


class CheckpointWriter:
    """A server's checkpoint and replica files, written by one thread of their own, in the order
    they were asked for. The state's maps are copied on the event loop (the kept versions' tensors
    never change) and pickled and written beside it: a step writes its new version's file (3 copies of
    the shard: parameters and AdamW moments) and the small file naming the kept ones, and writing on
    the loop held every call to the server while it ran.

    - `after_step(then)`: the checkpoint of the state now; `then()` runs on the loop once it is on
      disk (the request log may forget what the checkpoint holds only then). A crash before that
      leaves the previous checkpoint and a log that still covers it.
    - `now()`: write the state now and return when it is on disk (an adopted slot or a rollback
      must be durable before it is served).
    - `replica(slot)`: an awaitable that ends when the newest replica of `slot` is on disk (it is
      acknowledged only then)."""

    def __init__(self, server, directory: str):
        from concurrent.futures import ThreadPoolExecutor

        self.server, self.directory = server, directory
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"checkpoint-{server.device_id}")

    def _submit(self, fn, *args):
        return self._executor.submit(fn, *args)

    def after_step(self, then=None) -> None:
        import asyncio

        job = self._submit(write_checkpoint, self.directory, self.server.device_id, *checkpoint_state(self.server))
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (an in-process test stepping by hand): wait for it here
            job.result()
            if then is not None:
                then()
            return

        def done(f):
            if f.exception() is not None:
                logger.error("%s: writing the checkpoint failed: %r", self.server.device_id, f.exception())
            elif then is not None:
                then()

        job.add_done_callback(lambda f: loop.call_soon_threadsafe(done, f))

    def now(self) -> None:
        self._submit(write_checkpoint, self.directory, self.server.device_id, *checkpoint_state(self.server)).result()

    def replica(self, slot: int):
        import asyncio

        state = self.server.replicas[slot].state_dict()
        return asyncio.wrap_future(self._submit(write_replica, self.directory, self.server.device_id, slot, state))

    def flush(self):
        """A future done once every write asked for so far is on disk (the writer goes on)."""
        return self._submit(lambda: None)  # (one worker: it runs after what was queued before it)

    def close(self) -> None:
        """Wait for every write asked for."""
        self._executor.shutdown(wait=True)


def load_checkpoint(server, directory: str) -> bool:
    """Load the server's own slot; a slot it had taken over goes back among its replicas, from where
    the replay of its request log (which keeps the adopted layout epoch) takes it over again."""
    path = _path(directory, server.device_id)
    if not os.path.exists(path):
        return False
    state = blob.load(path)
    if "slots" not in state:  # a checkpoint of one shard, as written before failover existed
        state = {"own_slot": server.slot, "slots": {server.slot: state}}
    if (
        state.get("own_slot") != server.slot
        or server.slot not in state["slots"]
        or not all(isinstance(k, int) and 0 <= k < len(server.slot_names) for k in state["slots"])
    ):
        raise ValueError(
            f"checkpoint {path} holds shard slots {sorted(state['slots'])} of a server whose own slot "
            f"is {state.get('own_slot')}, not {server.slot}: not this server's checkpoint"
        )
    shards = {slot: server.shard if slot == server.slot else server.new_shard(slot) for slot in state["slots"]}
    saved = {slot: _history_in(directory, state["slots"][slot]) for slot in shards}
    for slot, shard in shards.items():  # every slot checked before anything is loaded
        missing = set(shard.names) - set(_current_params(directory, saved[slot]))
        if missing:
            raise ValueError(
                f"checkpoint {path} lacks {sorted(missing)[:3]} of shard slot {slot}: not this server's shard"
            )
    for slot, shard in shards.items():
        shard.load_state_dict(saved[slot])
        if slot != server.slot:
            server.replicas[slot] = shard
    _load_replicas(server, directory)
    server.dp.next_batch = server.shard.version
    return True


def _load_replicas(server, directory: str) -> None:
    """Replica files newer than what the checkpoint holds of those slots."""
    for slot in range(len(server.slot_names)):
        path = _replica_path(directory, server.device_id, slot)
        if slot == server.slot or not os.path.exists(path):
            continue
        try:
            saved = blob.load(path)
        except Exception as e:  # a torn file cannot be: it is written aside and renamed
            raise ValueError(f"replica {path} does not load: {e}") from None
        current = server.replicas.get(slot)
        if current is None or saved["version"] > current.version:
            shard = server.new_shard(slot)
            shard.load_state_dict(_history_in(directory, saved))
            server.replicas[slot] = shard


def read_model(directories) -> tuple[dict, dict]:
    """The model the servers' checkpoints in `directories` hold: (parameter name -> tensor, shard
    version of each parameter). Every checkpoint file's slots are read; where two hold the same
    parameter (a replica after a failover), the higher version wins. ValueError names a folder
    without checkpoints or a file that does not load."""
    state: dict = {}
    versions: dict = {}
    for directory in directories:
        files = sorted(f for f in os.listdir(directory) if f.endswith(".shard.pt"))
        if not files:
            raise ValueError(f"{directory}: no server checkpoint (*.shard.pt) in it")
        for name in files:
            path = os.path.join(directory, name)
            try:
                saved = blob.load(path)
            except Exception as e:
                raise ValueError(f"{path}: not a server checkpoint ({e})") from None
            slots = saved["slots"] if "slots" in saved else {0: saved}
            for shard in slots.values():
                for n, p in _current_params(directory, shard).items():
                    if versions.get(n, -1) < shard["version"]:
                        state[n], versions[n] = p, shard["version"]
    return state, versions
