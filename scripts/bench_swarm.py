#!/usr/bin/env python3
"""What the swarm costs against one process: tokens/s, the price of one hop, and bytes on the wire.

    python scripts/bench_swarm.py [--steps 60] [--model small] [--out docs/bench_swarm.md] [--work DIR]

Parts (markdown tables on standard output and in --out, each with the load average):

1. throughput: `peer reference` and `peer swarm` (2 stages x 2 servers, 4 volunteers, servers
   compute too) on the same model, steps and machine: tokens/s, their ratio, wall and startup seconds;
   and where the swarm's processor time goes while it trains (servers, volunteers, their DHT
   processes, the p2p daemons, the launcher), per step, against a step of the single process.
2. one hop: for activation tensors of one micro-batch share of the model (rows x seq_len x hidden,
   fp32) and of 4 MiB and 32 MiB, the serialization (`core.protocol.wire.pack`), deserialization
   (`unpack`), and transport: a real P2P round trip between two hivemind peers on 127.0.0.1 (two DHT
   nodes, a minimal ServicerBase echo handler) carrying the packed payload one way and a tiny answer
   back, without (de)serializing; median of repeats.
3. bytes on the wire: the swarm's `bytes_on_wire / steps` and its breakdown by method, against the
   minimum per step: the activations of the batch forward and their gradients back at every stage
   boundary, plus every parameter once as a gradient push and once as a parameter pull.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import AsyncIterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
import psutil  # noqa: E402
import torch  # noqa: E402
from _bench_common import REPO, Report, exactly_once, loadavg, md_table, process_tree, run_reference, run_swarm  # noqa: E402
from hivemind.p2p import P2PContext, ServicerBase  # noqa: E402
from hivemind.proto.runtime_pb2 import ExpertRequest, ExpertResponse  # noqa: E402

from core.model.config import get_preset  # noqa: E402
from core.protocol import session  # noqa: E402
from core.protocol.wire import encode_meta, pack, payload_bytes, stream_of, unpack  # noqa: E402
from peer.addresses import visible_maddrs  # noqa: E402
from peer.node import start_dht  # noqa: E402

MIB = 1 << 20
SWARM = dict(stages=2, servers_per_stage=2, volunteers=4, batch_size=16, micro_batches=4)


CPU_KINDS = ("server", "volunteer", "DHT process", "p2p daemon", "launcher")


def cpu_table(swarms: list[dict], refs: list[dict]) -> str:
    """Processor seconds per step of each kind of process in each swarm run (scripts/_bench_common.py
    CpuSampler, from the first step to the last), against one step of `peer reference`."""
    totals = [sum(sw["cpu"].values()) for sw in swarms]
    rows = []
    for kind in CPU_KINDS:
        rows.append(
            [kind]
            + [
                f"{sw['cpu'].get(kind, 0.0) / sw['steps']:.3f} ({sw['cpu'].get(kind, 0.0) / max(total, 1e-9):.0%})"
                for sw, total in zip(swarms, totals)
            ]
        )
    rows.append(
        ["all"]
        + [f"{total / sw['steps']:.3f} ({total / sw['wall_seconds']:.2f} cores)" for sw, total in zip(swarms, totals)]
    )
    rows.append(
        ["`peer reference`: wall seconds a step (one process, one thread: the arithmetic)"]
        + [f"{r['wall_seconds'] / r['steps']:.3f}" for r in refs]
    )
    return (
        md_table(["processes", *(f"swarm #{i + 1}: CPU-s a step (share)" for i in range(len(swarms)))], rows)
        + "\n\nServers and volunteers are the training processes (a server computes too); each has its "
        "hivemind DHT process and p2p daemon (which carries its RPCs and its DHT's); the launcher is "
        "`peer swarm` itself, the zygote that forks the others, and their DHT node. Sampled with psutil "
        "every 0.25 s."
    )


class Echo(ServicerBase):
    """Reads a request to its end without deserializing it, answers with its size."""

    async def rpc_echo(
        self, requests: AsyncIterator[ExpertRequest], context: P2PContext
    ) -> AsyncIterator[ExpertResponse]:
        yield ExpertResponse(metadata=await _size_of(requests))

    async def rpc_session(
        self, requests: AsyncIterator[ExpertRequest], context: P2PContext
    ) -> AsyncIterator[ExpertRequest]:
        """The same over a session (core/protocol/session.py), as the swarm sends every call."""

        async def echo(method, messages):
            yield ExpertRequest(metadata=await _size_of(messages))

        async for message in session.serve(requests, echo, 1 << 30):
            yield message


async def _size_of(messages: AsyncIterator[ExpertRequest]) -> bytes:
    """The answer's metadata: the bytes the request's messages carried (read, not deserialized)."""
    n = 0
    async for message in messages:
        n += len(message.metadata) + sum(len(part.buffer) for part in message.tensors)
    return encode_meta({"bytes": n})


STREAM_ROW, SESSION_ROW = " (a stream call of its own)", " (over an open session)"


def _tree_cpu() -> float:
    """Processor seconds of this process and its children (the two DHT processes and their daemons)."""
    total = 0.0
    for p in process_tree(os.getpid()):
        try:
            total += sum(p.cpu_times()[:2])
        except psutil.Error:
            pass
    return total


async def hop_costs(payloads: list[tuple[str, tuple[int, ...]]], repeats: int) -> list[list]:
    """Rows of the per-hop table: serialize, deserialize and transport medians for each payload, the
    transport as a stream call of its own (a row whose label ends in STREAM_ROW) and over an open
    session (SESSION_ROW), each with the processor time a call costs both ends and both daemons."""
    server = start_dht([], run_id="bench-hop", run_fp=None)
    client = start_dht(visible_maddrs(server), run_id="bench-hop", run_fp=None)
    try:
        p2p_server = await server.replicate_p2p()
        p2p_client = await client.replicate_p2p()
        await Echo().add_p2p_handlers(p2p_server)
        stub = Echo.get_stub(p2p_client, p2p_server.peer_id)
        open_session = await session.Session().open(
            p2p_client, str(p2p_server.peer_id), session.handle_name(Echo.__name__)
        )
        rows = []
        for label, shape in payloads:
            tensors = [torch.randn(shape)] if shape else []
            n = max(3, repeats if not shape or torch.Size(shape).numel() * 4 < 8 * MIB else repeats // 4)
            meta = {"task": "F0.0.0.0-4", "rows": [0, 4]}
            nbytes = payload_bytes(pack(meta, tensors, ExpertRequest))
            ser, de = [], []
            for i in range(n + 1):  # the first round warms up
                t0 = time.perf_counter()
                messages = pack(meta, tensors, ExpertRequest)
                t1 = time.perf_counter()
                await unpack(stream_of(messages))
                if i:
                    ser.append(t1 - t0)
                    de.append(time.perf_counter() - t1)
            s, d = (statistics.median(x) * 1e3 for x in (ser, de))

            async def by_stream():
                async for _ in await stub.rpc_echo(stream_of(messages)):
                    pass

            async def by_session():
                async for _ in open_session.call("ping", messages):
                    pass

            for how, call in ((STREAM_ROW, by_stream), (SESSION_ROW, by_session)):
                await call()  # warm-up
                rtt = []
                cpu0 = _tree_cpu()
                for _ in range(n):
                    t0 = time.perf_counter()
                    await call()
                    rtt.append(time.perf_counter() - t0)
                cpu = (_tree_cpu() - cpu0) / n * 1e3
                ms = statistics.median(rtt) * 1e3
                rows.append(
                    [
                        label + how,
                        f"{nbytes:,}",
                        n,
                        f"{s:.2f}",
                        f"{d:.2f}",
                        f"{ms:.2f}",
                        f"{s + d + ms:.2f}",
                        f"{cpu:.1f}",
                        f"{nbytes / 1e6 / (ms / 1e3):.0f}" if shape else "-",
                        loadavg(),
                    ]
                )
        open_session.close()
        await asyncio.wait_for(open_session.reader, 10.0)  # (the server ends the stream once ours is closed)
        return rows
    finally:
        client.shutdown()
        server.shutdown()


def minimum_bytes_per_step(cfg, stages: int, batch_size: int) -> dict:
    """The floor of the issue: activations and their gradients at each of the K-1 boundaries, every
    parameter once as a gradient push and once as a parameter pull (fp32)."""
    boundary = 2 * batch_size * cfg.seq_len * cfg.hidden * 4
    params = 2 * cfg.param_count() * 4
    return {"boundaries": (stages - 1) * boundary, "parameters": params, "total": (stages - 1) * boundary + params}


def per_worker_exchange(cfg, layout_stages: int, servers_per_stage: int, volunteers: int, batch_size: int) -> int:
    """The cost model's aggregation for this layout: every worker pushes and pulls its whole stage once
    per step (a server's own worker only the other servers' shards); boundaries as above. Not a
    floor: a volunteer that computes nothing on some version pulls nothing for it."""
    from core.layout import segment

    total = minimum_bytes_per_step(cfg, layout_stages, batch_size)["boundaries"]
    for k in range(layout_stages):
        lo, hi = segment(cfg.layers, layout_stages, k)
        stage_bytes = cfg.param_count(lo, hi) * 4
        clients = len([i for i in range(volunteers) if i % layout_stages == k])
        total += 2 * stage_bytes * clients + 2 * stage_bytes * (servers_per_stage - 1)  # servers: n * (n-1)/n
    return total


def method_rows(summary: dict, steps: int) -> list[list]:
    by_method: dict[str, list[int]] = {}
    for key, nbytes in summary["traffic"].items():
        method, direction = key.rsplit(".", 1)
        by_method.setdefault(method, [0, 0])[0 if direction == "request" else 1] += nbytes
    total = summary["bytes_on_wire"]
    rows = []
    for method, (req, resp) in sorted(by_method.items(), key=lambda kv: -sum(kv[1])):
        rows.append(
            [
                method,
                f"{req / steps / 1e6:.3f}",
                f"{resp / steps / 1e6:.3f}",
                f"{(req + resp) / steps / 1e6:.3f}",
                f"{100 * (req + resp) / total:.1f}%",
            ]
        )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--steps", type=int, default=60, help="batches each run trains on (default 60, as `peer swarm` by default)"
    )
    p.add_argument("--model", default="small")
    p.add_argument(
        "--runs", type=int, default=2, help="runs of each of reference and swarm (wall times vary with the load)"
    )
    p.add_argument("--repeats", type=int, default=20, help="repeats per payload of the hop timing (fewer for big ones)")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "bench_swarm.md")
    p.add_argument("--work", type=Path, default=None, help="logs and summaries (default: a temporary folder)")
    args = p.parse_args(argv)
    cfg = get_preset(args.model)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-swarm-"))
    work.mkdir(parents=True, exist_ok=True)
    s = SWARM
    rows_share = s["batch_size"] // s["micro_batches"]
    report = Report(
        "Swarm benchmark",
        f"""
`python scripts/bench_swarm.py --steps {args.steps} --model {args.model}` on this 2-core, no-GPU machine,
shared with other jobs: every table says the load average (1/5/15 min) when it was measured. Model
`{args.model}` ({cfg.param_count():,} parameters, hidden {cfg.hidden}, seq_len {cfg.seq_len}); batch
{s["batch_size"]} sequences in {s["micro_batches"]} micro-batches; the swarm is {s["stages"]} stages x
{s["servers_per_stage"]} servers (servers compute too) + {s["volunteers"]} volunteers, each its own
process with one torch thread. Logs and summaries of this run: `{work}`.""",
    )

    # 1. throughput ------------------------------------------------------------------------------
    refs, swarms = [], []
    for i in range(args.runs):  # alternated, so that a change of the machine's load hits both
        refs.append(run_reference(args.model, args.steps, work / f"reference-{i}"))
        swarms.append(
            run_swarm(
                f"swarm-{i}",
                [
                    "--model",
                    args.model,
                    "--steps",
                    str(args.steps),
                    "--stages",
                    str(s["stages"]),
                    "--servers-per-stage",
                    str(s["servers_per_stage"]),
                    "--volunteers",
                    str(s["volunteers"]),
                ],
                work,
                sample_cpu=True,
            )
        )
    ref_tps = statistics.median(r["tokens_per_second"] for r in refs)
    ratio = statistics.median(r["tokens_per_second"] for r in swarms) / ref_tps
    table = []
    for i, (ref, sw) in enumerate(zip(refs, swarms)):
        table.append(
            [
                f"`peer reference` #{i + 1}",
                ref["steps"],
                f"{ref['tokens_per_second']:,.0f}",
                f"{ref['tokens_per_second'] / ref_tps:.2f}",
                f"{ref['wall_seconds']:.1f}",
                "-",
                "-",
                f"{ref['first_loss']:.3f} → {ref['last_loss']:.3f}",
                "-",
                ref["load"],
            ]
        )
        table.append(
            [
                f"`peer swarm` #{i + 1}",
                sw["steps"],
                f"{sw['tokens_per_second']:,.0f}",
                f"{sw['tokens_per_second'] / ref_tps:.3f}",
                f"{sw['wall_seconds']:.1f}",
                f"{sw['startup_seconds']:.1f}",
                f"{sw['bytes_on_wire'] / sw['steps'] / 1e6:.1f}",
                f"{sw['first_loss']:.3f} → {sw['last_loss']:.3f}",
                exactly_once(sw),
                sw["load"],
            ]
        )
    report.section(
        "Throughput: swarm against one process",
        md_table(
            [
                "run",
                "steps",
                "tokens/s",
                "vs reference (median)",
                "wall s (training)",
                "startup s",
                "MB on wire / step",
                "loss first → last",
                "micro-batches applied",
                "load at start",
            ],
            table,
        )
        + f"\n\nMedian swarm / median reference: **{ratio:.3f}**. Duplicate contributions dropped: "
        f"{', '.join(str(sw['duplicates_dropped']) for sw in swarms)}; leases re-queued: "
        f"{', '.join(str(sw['requeued']) for sw in swarms)}.",
    )
    report.section("Where the processor time goes (training only)", cpu_table(swarms, refs))
    swarm, ref = swarms[0], refs[0]

    # 2. one hop ---------------------------------------------------------------------------------
    payloads = [
        ("metadata only", ()),
        (f"1 row x {cfg.seq_len} x {cfg.hidden} fp32 (a share)", (1, cfg.seq_len, cfg.hidden)),
        (
            f"{rows_share} rows x {cfg.seq_len} x {cfg.hidden} fp32 (a micro-batch)",
            (rows_share, cfg.seq_len, cfg.hidden),
        ),
        ("4 MiB fp32", (1, MIB)),
        ("32 MiB fp32", (8, MIB)),
    ]
    all_hop_rows = asyncio.run(hop_costs(payloads, args.repeats))
    hop_rows = [r for r in all_hop_rows if r[0].endswith(SESSION_ROW)]  # how the swarm calls
    stream_rows = [r for r in all_hop_rows if r[0].endswith(STREAM_ROW)]
    report.section(
        "One hop: serialization and transport",
        """
Serialize = `wire.pack` (hivemind tensor serialization, 1 MiB chunks, protobuf messages); deserialize =
`wire.unpack`; transport = a P2P round trip between two hivemind peers on 127.0.0.1 (each its own DHT
and p2p daemon) carrying the packed request one way and a tiny answer back, without touching the
tensors: as a stream call of its own (a new connection to the daemon, a new libp2p stream and its
protocol negotiation), and over an open session (core/protocol/session.py: the calls to one server
multiplexed over one long-lived stream), as the swarm sends every call. One hop as the swarm makes it =
serialize + transport + deserialize. Medians; the first round is a warm-up and not counted. Processor
time = of both ends and both p2p daemons, a call's transport only (psutil over the rounds: 10 ms
ticks, so +-10 ms / repeats).
"""
        + "\n"
        + md_table(
            [
                "payload",
                "bytes on the wire",
                "repeats",
                "serialize ms",
                "deserialize ms",
                "transport ms (round trip)",
                "hop ms",
                "transport processor ms (all four processes)",
                "transport MB/s",
                "load",
            ],
            all_hop_rows,
        ),
    )

    # 3. bytes on the wire -----------------------------------------------------------------------
    steps = swarm["steps"]
    floor = minimum_bytes_per_step(cfg, s["stages"], s["batch_size"])
    exchange = per_worker_exchange(cfg, s["stages"], s["servers_per_stage"], s["volunteers"], s["batch_size"])
    measured = swarm["bytes_on_wire"] / steps
    report.section(
        "Bytes on the wire per step (swarm run #1)",
        md_table(
            ["what", "MB per step", "measured / this"],
            [
                [
                    "measured: `bytes_on_wire / steps` (all bytes the servers received and answered)",
                    f"{measured / 1e6:.2f}",
                    "1",
                ],
                [
                    f"minimum: activations + gradients at {s['stages'] - 1} boundary ({floor['boundaries'] / 1e6:.2f} MB) "
                    f"+ every parameter pushed and pulled once ({floor['parameters'] / 1e6:.2f} MB)",
                    f"{floor['total'] / 1e6:.2f}",
                    f"{measured / floor['total']:.1f}",
                ],
                [
                    "the cost model's exchange for this layout: boundaries + every worker pushes and pulls its "
                    "stage (but a server's own shard) once per step",
                    f"{exchange / 1e6:.2f}",
                    f"{measured / exchange:.1f}",
                ],
            ],
        )
        + f"\n\nBy method (per step, load at the swarm's start {swarm['load']}):\n\n"
        + md_table(["method", "request MB", "response MB", "total MB", "share"], method_rows(swarm, steps)),
    )
    report.section("RPCs per micro-batch share (each swarm run)", rpc_text(swarms))
    grads_per_step = swarm["traffic"].get("push_grads.request", 0) / steps
    report.section(
        "Reading the numbers",
        interpretation(cfg, s, swarms, ratio, hop_rows, stream_rows, measured, floor, exchange, grads_per_step),
    )
    report.write(args.out)
    return 0


# what a worker calls for its tasks, what it calls to stay registered, what servers call each other
TASK_PATH = ("take", "complete", "fail", "push_outputs", "push_input_grads", "push_grads", "get_inputs", "get_params")
UPKEEP = ("register",)


def rpc_text(swarms: list[dict]) -> str:
    """Calls that reached a server over the network, per task (a micro-batch share: the rows of one
    micro-batch one worker computes at one stage); a server's own worker calls its own server in-process."""
    rows = []
    for i, sw in enumerate(swarms):
        calls, tasks = sw.get("rpc_calls", {}), max(sw["tasks_completed"], 1)
        path = sum(calls.get(m, 0) for m in TASK_PATH)
        empty = max(calls.get("take", 0) - tasks, 0)  # takes that found nothing (at most one per task found one)
        upkeep = sum(calls.get(m, 0) for m in UPKEEP)
        between = sum(v for m, v in calls.items() if m not in TASK_PATH + UPKEEP + ("status",))
        found = sw.get("takes_empty", {})
        split = (
            f"{found.get('takes_found_nothing', 0) / tasks:.2f} / {found.get('takes_waited_out', 0) / tasks:.2f}"
            if found
            else "-"
        )
        over_session = sum(sw.get("rpc_session_calls", {}).values())
        rows.append(
            [
                f"#{i + 1}",
                tasks,
                f"{path / tasks:.2f}",
                f"{(path - empty) / tasks:.2f}",
                split,
                f"{upkeep / tasks:.2f}",
                f"{between / tasks:.2f}",
                f"{over_session / max(sum(calls.values()), 1):.0%}",
                ", ".join(f"{m} {calls.get(m, 0) / tasks:.2f}" for m in TASK_PATH if calls.get(m)),
            ]
        )
    return "\n" + md_table(
        [
            "run",
            "tasks",
            "task-path calls per task",
            "without takes that found nothing",
            "takes that found nothing per task: at once / after waiting",
            "heartbeats per task",
            "server-to-server calls per task",
            "of all calls, over a session",
            "by method, per task",
        ],
        rows,
    )


def interpretation(cfg, s, swarms, ratio, hop_rows, stream_rows, measured, floor, exchange, grads_per_step) -> str:
    tps = [sw["tokens_per_second"] for sw in swarms]
    startup = statistics.median(sw["startup_seconds"] for sw in swarms)
    stage_bytes = cfg.param_count() * 4 / s["stages"]  # about one stage's gradient
    pushes = grads_per_step / stage_bytes / s["stages"]
    meta_hop = float(hop_rows[0][6])
    share_hop = float(hop_rows[2][6])
    big = hop_rows[-1]
    big_codec = (float(big[3]) + float(big[4])) / float(big[6])
    share_codec = (float(hop_rows[2][3]) + float(hop_rows[2][4])) / share_hop
    return f"""
- **Throughput.** The swarm reaches {ratio:.2f}x the single process's tokens/s on the same 2 cores. The
  reference is one process doing only arithmetic; the swarm runs {s["stages"] * s["servers_per_stage"] + s["volunteers"]}
  training processes, each with its own DHT process and p2p daemon, on those 2 cores, and does more work
  per token: every tensor crosses process boundaries 2 to 3 times (worker → server → worker), each
  batch's parameters are pulled and its gradient sum pushed by every client it is cut for, each
  server sends each step of its shard to a replica and checkpoints it, and every task costs its own calls
  (section "RPCs" above); a backward task taken by another worker than the forward's recomputes it. The
  swarm's `wall_seconds` starts once every server is online, so the {startup:.0f} s of
  startup is not in its tokens/s. The swarm's runs differ by {max(tps) / min(tps):.1f}x here, and runs
  of the same command during this work differed by up to 3x, with the other jobs' load: every process
  of the swarm is runnable at once, so it suffers more from a busy machine than one process does. The swarm exists to use machines that one process cannot; on one
  machine it can only lose.
- **One hop.** Over an open session a metadata-only call costs {meta_hop:.2f} ms and a micro-batch of
  activations {share_hop:.2f} ms, (de)serialization {100 * share_codec:.0f}% of it; as a stream call of its
  own they cost {float(stream_rows[0][6]):.2f} and {float(stream_rows[2][6]):.2f} ms, and {float(stream_rows[0][7]):.1f} against
  {float(hop_rows[0][7]):.1f} ms of processor time for the empty call: opening a stream (a connection to the
  local daemon, a libp2p stream and its protocol negotiation, a connection from the remote daemon to the
  handler) costs more than the call, which is why the swarm keeps one session a server.
  For {big[0]} it is {100 * big_codec:.0f}%: hivemind's serialization copies the tensor into
  protobuf chunks and back, at a speed of the same order as loopback transport, which itself stays
  far below memory bandwidth (every byte goes Python → p2p daemon → TCP → p2p daemon → Python).
- **Bytes.** The swarm moved {measured / 1e6:.1f} MB per step, {measured / floor["total"]:.1f}x the issue's
  minimum ({floor["total"] / 1e6:.2f} MB) and {measured / exchange:.1f}x what the cost model's aggregation term
  counts for this layout (every worker pushes and pulls its stage once per step, {exchange / 1e6:.1f} MB).
  What it is made of:
  - *one gradient per client and batch, not one per stage*: a worker sums the gradients of its tasks
    of a batch and pushes the sum, sharded, with the ids of the tasks it covers (each server credits
    it all or nothing). `push_grads` carried {grads_per_step / 1e6:.1f} MB per step, about {pushes:.1f}
    whole-stage gradients per stage per step: a batch goes to as few of a stage's {s["servers_per_stage"]} servers'
    own workers and {s["volunteers"] // s["stages"]} volunteers as give each `--client-batch-tokens` (one by
    default), a free server's worker first (`--no-local-first`: by the rows each is owed); a server's own
    worker keeps its own shard local, an idle worker holds a batch's sum while tasks of it are owed to
    it, and a sum is pushed early when a lease nears its deadline or a task of the batch went to another
    worker;
  - *parameters re-pulled for every version a client computes on* (`get_params`): a volunteer pulls
    its stage's parameters for each batch it is cut for; a server's own worker reads the other servers'
    shards from the replicas its server keeps when their hosts' digests agree, a small `get_params` each;
  - *replicas*: every server sends each step of its shard (the summed gradient) to the server keeping
    its replica, so that a server lost for good is failed over without losing a step (`push_replica`,
    up to one stage's parameters a stage and step), its digest only when the sum is the one push of
    the replica's own server's worker, which that server holds already;
  - *activations move 3 times per boundary, not once*: worker → BS (`push_outputs`), BS → next FS
    (`push_inputs`), FS → worker (in the `take` answer), and gradients the same way back
    (`push_input_grads`, the relay `push_output_grads`, `take`); a server's own worker saves one hop;
  - *inputs fetched again for recomputation*: a backward task taken by a client other than the one
    that ran the forward fetches its inputs from the FS (`get_inputs`);
  - the rest is control traffic (`take`, `register` heartbeats, which carry the finished tasks), small per call but many
    calls.
  On a real network the activations' extra hops are the term to cut next: a worker could push its
  outputs straight to the next stage's FS, at the price of the BS's ledger seeing them second-hand.
"""


if __name__ == "__main__":
    sys.exit(main())
