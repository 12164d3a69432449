"""`peer serve --reliable`: one parameter server (frontal or backward) of one stage."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
import tempfile

from peer.errors import NetworkError, UsageError
from peer.runtime import (
    check_common,
    freeze_startup_objects,
    run_until_signalled,
)
from peer.serve_flags import add_arguments, resolve  # noqa: F401  (the command's flags: peer/cli.py reads them here)

logger = logging.getLogger("hivepipe.serve")


def run(args) -> int:
    check_common(args)
    if args.supervise:
        if not args.checkpoint_dir:
            raise UsageError("--supervise restarts a crashed server from its checkpoint: give --checkpoint-dir")
        from tqdm import tqdm

        tqdm.monitor_interval = 0  # no monitor thread behind the corpus's progress bar: the supervisor forks
    cfg, layout, device, run_cfg = resolve(args)
    stage, role, _ = layout.locate(device)
    corpus = None
    # the run's data, read where a batch begins (stage 0's frontal servers: inputs) and where a loss is
    # computed (the last stage's: labels), so that what a loss is computed against never passes
    # through a volunteer
    if role == "frontal" and stage in (0, layout.num_stages - 1):
        from peer.hf.init import load_training_corpus

        corpus = load_training_corpus(args.data, cfg, args.hf_model, progress=args.parent_pid is None)
        run_cfg = dataclasses.replace(run_cfg, data=corpus.fingerprint)  # (a server with other data is refused)
    from peer.lifetime import watch_parent

    if not args.supervise:
        watch_parent(args.parent_pid)
        return run_until_signalled(lambda stop: serve_main(args, cfg, layout, device, run_cfg, corpus, stop))
    from peer.supervisor import supervise

    if args.identity_path is None:  # a restarted server must come back under the same peer id
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        args.identity_path = os.path.join(args.checkpoint_dir, f"{device}.identity.key")
    preload_server_modules()
    # the host's DHT node (with its p2p daemon) is the supervisor's: it outlives a crashed server
    # process, so a restart starts no node (seconds under load), keeps the peers' connections and
    # the addresses they know, and takes its stream handlers over (peer.node.HeldNode)
    import torch.multiprocessing

    from peer.node import HeldNode, dht_leaves_with, stop_dht

    # hivemind shares its futures' state through torch shared memory, by default (strategy
    # "file_system") through a manager process with one connection per process: a forked child
    # would share the supervisor's (a child SIGKILLed mid-message broke it for every later one), or
    # start its own (0.2 s idle, more under load, and its segments left behind at each SIGKILL).
    # The supervisor and its server processes share by file descriptor: no manager at all.
    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    from peer.host.network import start_server_dht
    from peer.host.options import ServerOptions

    args.identity_existed = os.path.exists(args.identity_path)  # (its first server process checks it)
    dht = start_server_dht(ServerOptions.from_args(args), run_cfg, device)
    dht_leaves_with(dht, os.getpid())
    held = HeldNode.of(dht, os.path.join(tempfile.gettempdir(), f"hivepipe-{os.getpid()}-{device[:40]}.sock"))

    def child(supervisor_pid: int, run: int) -> int:
        watch_parent(supervisor_pid)
        args.restarted = run > 0  # the node was checked reachable by the first server process
        try:
            return run_until_signalled(
                lambda stop: serve_main(args, cfg, layout, device, run_cfg, corpus, stop, held=held)
            )
        except (UsageError, NetworkError) as e:
            print(f"peer serve: error: {e}", file=sys.stderr, flush=True)
            return 2

    try:
        return supervise(
            child,
            name=device,
            parent_pid=args.parent_pid,
            needs=lambda: None if dht.is_alive() else "its DHT process is gone",
        )
    finally:
        stop_dht(dht)
        try:
            os.unlink(held.socket_path)
        except OSError:
            pass


def preload_server_modules() -> None:
    """Import what serve_main imports, before the supervisor (or the swarm's zygote) forks: a
    restarted child pays for none of it (no thread, no event loop and no CUDA context is started by
    these imports)."""
    import torch

    import core.protocol.records  # noqa: F401
    import parameter_server.checkpoint  # noqa: F401
    import parameter_server.requestlog  # noqa: F401
    import parameter_server.service  # noqa: F401
    import peer.hf.init  # noqa: F401
    import peer.host.server  # noqa: F401
    import peer.node  # noqa: F401
    import peer.reachability  # noqa: F401
    import peer.volunteer.worker  # noqa: F401

    # the first optimizer imports torch._dynamo (1.6 s here idle, 7.8 s under a soak's load)
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    # what was imported outlives every child forked from here: frozen now, each child's own
    # freeze_startup_objects walks only what that child built (it walked all of it again in each,
    # 326,000 objects, 0.25-0.28 CPU-s a child here), and the children leave those pages unwritten
    freeze_startup_objects()


async def serve_main(args, cfg, layout, device, run_cfg, corpus, stop: asyncio.Event, held=None) -> int:
    """Serve `device` until the run finishes or `stop`: on `held` (a peer.node.HeldNode: a
    supervisor's), or on a DHT node of its own."""
    import torch

    from peer.host.options import ServerOptions
    from peer.host.server import ServerHost

    torch.set_num_threads(1)
    return await ServerHost(ServerOptions.from_args(args), cfg, layout, device, run_cfg, corpus, held=held).run(stop)
