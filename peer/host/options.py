"""What a server's life reads of its command line (`peer serve --reliable`), as one typed value:
ServerHost and the functions it calls take this, not the argparse namespace, so that what a server
depends on is listed here and a test can make one without a parser."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields


@dataclass
class ServerOptions:
    # the network
    initial_peers: list[str]  # the DHT's multiaddrs it joins through ([] for a first server)
    host_maddrs: list[str] | None  # where it listens (None: loopback)
    announce_maddrs: list[str] | None  # what it announces, when others reach it elsewhere (NAT)
    identity_path: str | None  # its peer id's key (a restart comes back under the same one)
    timeout: float | None  # seconds to wait for its initial peers (None: 60)
    no_reachability_check: bool  # do not ask a peer of the run to dial it back
    link_profile: str | None  # a cluster file whose links are emulated (core.protocol.links)
    link_scale: float
    # the run's key (core.protocol.trust)
    run_key: str  # its file
    run_key_obj: object  # the key (a core.protocol.trust.SigningKey)
    run_fp: str  # its fingerprint, which volunteers pass in --run-id
    # the server
    device: str  # the torch device of its worker and its checks
    checkpoint_dir: str | None  # its shard after every step, its request log and kept peers
    no_compute: bool  # no worker of its own beside its services
    slowdown: float | None  # its worker's compute stretched this many times (None: the link profile's)
    activation_memory: float  # MiB of forward passes its worker keeps for their backward tasks
    hf_model: str | None  # --init-from: a Transformers model's initial parameters
    failover_after: float  # seconds of a server's silence before it counts as lost
    # its services (parameter_server.service.StageServer)
    task_timeout: float
    client_timeout: float
    no_requeue: bool
    max_request_bytes: int | None
    allowed: frozenset[str] | None  # peer ids a closed run admits (--volunteers-allow)
    verify_rate: float
    probation: int
    ban_reach: int  # versions of each shard kept on disk for bans beyond memory's (old_versions.py)
    ban_reach_gb: float  # at most this much disk for them
    task_tokens: int
    client_batch_tokens: int
    no_local_first: bool
    # set by `peer serve` for some starts only
    run_key_new: bool = False  # this start made the run key: it is written once the run admits it
    identity_existed: bool = False  # its identity was on disk before (a live twin may hold it)
    restarted: bool = False  # a supervised server's later process (reachability already checked)
    log_dir: str | None = None  # --log-dir: a CSV and TensorBoard events of its steps
    hold: bool = False  # serve the final state until stopped
    die_at_version: int | None = None  # a test's fault: lost for good after applying that step

    @classmethod
    def from_args(cls, args) -> "ServerOptions":
        """From `peer serve`'s parsed and checked arguments; a field without a default must be there."""
        values = {}
        for f in fields(cls):
            if f.default is MISSING:
                values[f.name] = getattr(args, f.name)
            else:
                values[f.name] = getattr(args, f.name, f.default)
        values["initial_peers"] = list(values["initial_peers"] or [])
        return cls(**values)
