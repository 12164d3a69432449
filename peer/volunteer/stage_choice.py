"""`--stage auto`: a volunteer measures its links to every server of the run once (real P2P pings,
small and large), then chooses its stage, and later re-chooses it, from the DHT records with
scheduler/balance.py (the cost model on the compute each stage has now), every period while it
works (`better_stage`). Moving is the caller's (peer/host/volunteer.py)."""

from __future__ import annotations

import logging
import time

from core.protocol.aio import check_cancelled
from core.protocol.records import RecordState

logger = logging.getLogger("hivepipe.join")


async def probe_stage(links: list, nbytes: int, device: str, repeats: int = 3) -> tuple[list[float], list[float]]:
    """One-way delay (s) and bandwidth (bytes/s) to each server, from real P2P calls: a tiny ping
    gives the round trip, a ping carrying `nbytes` the transfer time."""
    import torch

    payload = torch.zeros(nbytes // 4, dtype=torch.float32)
    delays, bandwidths = [], []
    for link in links:
        small, big = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            await link.call("ping", {"device": device}, timeout=30)
            small.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await link.call("ping", {"device": device}, [payload], timeout=60)
            big.append(time.perf_counter() - t0)
        rtt, transfer = min(small), min(big)
        delays.append(rtt / 2)
        bandwidths.append(nbytes / max(transfer - rtt, 1e-6))
    return delays, bandwidths


def stage_bytes(run, cfg) -> int:
    """Bytes a client moves per micro-batch share: activations forward and gradients back."""
    return 2 * (run.batch_size // run.micro_batches) * cfg.seq_len * cfg.hidden * 4


def planner_model(run, cfg):
    """The run as the cost model's model file sees it (fp32 on the wire)."""
    from core.model.config import planner_model_file
    from scheduler import load_model

    return load_model(planner_model_file(cfg, run.batch_size, run.micro_batches, bytes_per_value=4))


def stages_now(
    stage_records: list[list[tuple[str, dict]]],
    layout,
    cfg,
    fresh=lambda rec: True,
    own_stage: int | None = None,
    own_flops: float = 0.0,
):
    """StageNow per stage from the stages' servers' records: each server's own worker's announced
    compute (rows/s of its slice) as FLOP/s, and the stage's volunteers as its servers count them
    (the record's `volunteers` and `volunteer_compute`: the server with the most of them, a volunteer
    being registered at every server of its stage), shared equally among them. Records that `fresh`
    says are stale are left out. The deciding volunteer, registered on `own_stage` with `own_flops`,
    is taken out of that stage's count. Reading the servers' records only keeps what a volunteer
    reads bounded by the servers, however many volunteers there are (docs/scale.md)."""
    from core.model.config import flops_per_token_per_layer
    from scheduler.balance import StageNow

    per_row_layer = cfg.seq_len * flops_per_token_per_layer(cfg)
    out = []
    for k, (st, recs) in enumerate(zip(layout.stages, stage_records)):
        n = st.layers[1] - st.layers[0]
        now = StageNow(frontal=list(st.frontal), backward=list(st.backward), layers=tuple(st.layers))
        counted = (0, 0.0)
        for _, rec in recs:
            if rec.get("kind") != "server" or rec.get("state") != RecordState.ONLINE or not fresh(rec):
                continue
            if rec["device"] in st.servers:
                now.server_flops[rec["device"]] = float(rec.get("compute") or 0.0) * per_row_layer * n
            stats = rec.get("stats") or {}
            count, rows_s = stats.get("volunteers"), stats.get("volunteer_compute")
            if isinstance(count, int) and isinstance(rows_s, (int, float)) and count > 0 and rows_s > 0:
                counted = max(counted, (count, float(rows_s) * per_row_layer * n))
        count, flops = counted
        if k == own_stage and count > 0:
            count, flops = count - 1, max(0.0, flops - own_flops)
        if count > 0 and flops > 0:
            now.volunteer_flops = [flops / count] * count
        out.append(now)
    return out


class StagePicker:
    """`--stage auto`: measures this volunteer's links to every stage once, then decides (and
    re-decides) its stage from the DHT records with scheduler.balance."""

    def __init__(self, run, layout, cfg, directory, p2p, links_emulator, peer_id: str, nbytes: int, own_rows_s: float):
        self.run, self.layout, self.cfg = run, layout, cfg
        self.directory, self.p2p, self.links_emulator = directory, p2p, links_emulator
        self.peer_id = peer_id
        self.nbytes = nbytes
        self.model = planner_model(run, cfg)
        from core.model.config import flops_per_token_per_layer

        # measured on stage 0's slice: as FLOP/s
        self.own_flops = (
            own_rows_s
            * cfg.seq_len
            * flops_per_token_per_layer(cfg)
            * (layout.stages[0].layers[1] - layout.stages[0].layers[0])
        )
        self.delays: list | None = None
        self.bandwidths: list | None = None

    async def measure(self) -> None:

        delays, bandwidths = [], []
        for st in self.layout.stages:
            links = [self.directory.link(self.p2p, d, self.links_emulator) for d in st.servers]
            dl, bw = await probe_stage(links, self.nbytes, self.links_emulator.own or "")
            delays.append(dl)
            bandwidths.append(bw)
            logger.info(
                "stage %d: delays %s ms, bandwidths %s MB/s",
                st.index,
                [round(d * 1e3, 1) for d in dl],
                [round(b / 1e6, 1) for b in bw],
            )
        self.delays, self.bandwidths = delays, bandwidths

    async def decide(self, current: int | None):
        from core.protocol import record_store, records
        from scheduler.balance import choose

        per_stage = [
            [(peer, rec) for peer, rec, _ in found if rec is not None]
            for found in await record_store.read_stages(self.directory.dht, self.run.run_id, self.layout.num_stages)
        ]
        stages = stages_now(
            per_stage,
            self.layout,
            self.cfg,
            fresh=lambda rec: records.is_fresh(rec, self.run.announce_period),
            own_stage=current,
            own_flops=self.own_flops,
        )
        decision = choose(
            stages, self.model, self.own_flops, self.delays, self.bandwidths, self.nbytes, current=current
        )
        computing = [f"{(sum(s.server_flops.values()) + sum(s.volunteer_flops)) / 1e9:.3g}" for s in stages]
        logger.info(
            "stage choice: %s; with this volunteer on each stage: %s; GFLOP/s computing now per stage: %s; "
            "link scores %s ms",
            decision.reason,
            ["%d empty" % p[0] if p[0] else "%.3g s" % p[1] for p in decision.predicted],
            computing,
            [round(x * 1e3, 1) for x in decision.link_scores],
        )
        return decision

    async def better_stage(self, who: str, stage: int, period: float, first_look: float, rng, pause) -> int | None:
        """Look again every `period` seconds (the first after `first_look`: volunteers that joined
        together saw the same records) whether another stage needs this volunteer more; the stage
        to move to, or None once `pause(seconds)` says it is leaving. A move is asked twice, a
        random pause apart, on fresh records, so that two volunteers that saw the same evidence do
        not both move. While some stage has no compute at all, it looks again within seconds."""
        wait = first_look
        while not await pause(wait):
            check_cancelled()
            try:
                decision = await self.decide(stage)
                wait = period if decision.stay[0] == 0 else min(period, 5.0)
                if not decision.moves:
                    continue
                if await pause(rng.uniform(0.0, min(period / 2, 10.0))):
                    return None
                again = await self.decide(stage)
            except Exception as e:
                logger.info("stage re-check failed: %r", e)
                continue
            if again.moves:
                logger.warning("%s: moving from stage %d to stage %d: %s", who, stage, again.stage, again.reason)
                return again.stage
        return None
