"""Cluster generators (cluster-file dicts, docs/cost-model.md) for the planner's
benchmarks and tests. Every generator takes a seed and is deterministic for it.

The cases of section 4.1 of papers/hybrid-ps-pipeline.txt (hps_*) and cases 1-3 of section
4.1 of papers/decentralized-fm-scheduling.txt (dfm_*), plus random clusters. Where the papers
leave a number out, the choice is written next to it. A V100 counts 14 TFLOP/s sustained and
16 GB, an RTX 2080 14 / 1.55 (the papers' 55% longer step) and 8 GB.
"""

from __future__ import annotations

import numpy as np

V100 = {"tflops": 14.0, "memory_gb": 16}
RTX2080 = {"tflops": round(14.0 / 1.55, 3), "memory_gb": 8}
GBPS = 8000.0  # 1 GB/s in Mb/s
DC_DELAY_MS = 0.1  # inside a datacenter or an HPC (the papers do not say)

# the model file of the spec's example (a 1.2B-parameter, 24-layer model)
EXAMPLE_MODEL = {"layers": 24, "hidden": 2048, "bytes_per_value": 2, "batch_tokens": 524288, "micro_batches": 128}


def _cluster(reliable, unreliable, delay_rr, bw_rr, delay_ur, bw_ur, name, meta=None, as_arrays=False) -> dict:
    R = len(reliable)
    delay_rr, bw_rr = np.array(delay_rr, dtype=float), np.array(bw_rr, dtype=float)
    np.fill_diagonal(delay_rr, 0.0)
    np.fill_diagonal(bw_rr, 0.0)
    delay_ur = np.asarray(delay_ur, dtype=float).reshape(len(unreliable), R)
    bw_ur = np.asarray(bw_ur, dtype=float).reshape(len(unreliable), R)
    conv = (lambda a: a) if as_arrays else (lambda a: np.round(a, 4).tolist())
    out = {
        "name": name,
        "reliable": reliable,
        "unreliable": unreliable,
        "delay_ms": {"reliable": conv(delay_rr), "unreliable": conv(delay_ur)},
        "bandwidth_mbps": {"reliable": conv(bw_rr), "unreliable": conv(bw_ur)},
    }
    if meta:
        out["meta"] = meta
    return out


def _devices(prefix, n, spec, start=0):
    return [{"id": f"{prefix}{start + i}", **spec} for i in range(n)]


def _sym(rng, M, jitter):
    """Each direction of each pair jittered by up to +-jitter (asymmetric links)."""
    return M * (1 + jitter * (2 * rng.random(M.shape) - 1))


def _sites(rng, sizes, intra_bw, intra_delay, inter_bw, inter_delay, jitter=0.05):
    """Reliable R x R matrices for devices grouped in sites; inter_* are (lo, hi) per site pair."""
    site = np.repeat(np.arange(len(sizes)), sizes)
    S = len(sizes)
    sbw = np.full((S, S), float(intra_bw))
    sdl = np.full((S, S), float(intra_delay))
    for a in range(S):
        for b in range(a + 1, S):
            sbw[a, b] = sbw[b, a] = rng.uniform(*inter_bw)
            sdl[a, b] = sdl[b, a] = rng.uniform(*inter_delay)
    return _sym(rng, sdl[np.ix_(site, site)], jitter), _sym(rng, sbw[np.ix_(site, site)], jitter)


def hps_datacenter(seed: int = 0) -> dict:
    """Case 1: one datacenter of 16 V100 at 2 GB/s."""
    rng = np.random.default_rng(seed)
    dl, bw = _sites(rng, [16], 2 * GBPS, DC_DELAY_MS, None, None, jitter=0.01)
    return _cluster(_devices("v", 16, V100), [], dl, bw, [], [], "hps case 1: datacenter, 16 V100 at 2 GB/s")


def hps_hpc4(seed: int = 0) -> dict:
    """Case 2: four HPCs of four V100; between HPCs 1-3 GB/s and 10-100 ms (per HPC pair)."""
    rng = np.random.default_rng(seed)
    dl, bw = _sites(rng, [4] * 4, 2 * GBPS, DC_DELAY_MS, (1 * GBPS, 3 * GBPS), (10.0, 100.0))
    return _cluster(_devices("v", 16, V100), [], dl, bw, [], [], "hps case 2: 4 HPCs x 4 V100, 1-3 GB/s, 10-100 ms")


def hps_hybrid(seed: int = 0, disconnections: bool = False) -> dict:
    """Case 3: two HPCs of four V100 (reliable) and eight RTX 2080 volunteers behind 50-300 Mb/s
    and 100-150 ms links (drawn per volunteer-server pair). Between the HPCs: 1-3 GB/s, 10-100 ms
    as in case 2."""
    rng = np.random.default_rng(seed)
    dl, bw = _sites(rng, [4, 4], 2 * GBPS, DC_DELAY_MS, (1 * GBPS, 3 * GBPS), (10.0, 100.0))
    U = 8
    dl_u = rng.uniform(100.0, 150.0, (U, 8))
    bw_u = rng.uniform(50.0, 300.0, (U, 8))
    vols = _devices("g", U, RTX2080)
    name = "hps case 3: 2 HPCs x 4 V100 + 8 RTX 2080 at 50-300 Mb/s, 100-150 ms"
    meta = None
    if disconnections:
        # Case 4: a volunteer disconnects during a batch with probability 0.9 and is back for the
        # next one. The static cost model has no churn, so a volunteer counts at its expected
        # worth: on average it loses half a batch's work and re-sends what it had in flight,
        # i.e. compute and bandwidth times 1 - 0.9 / 2.
        keep = 1 - 0.9 / 2
        for v in vols:
            v["tflops"] = round(v["tflops"] * keep, 3)
        bw_u = bw_u * keep
        name = "hps case 4: case 3 with disconnections (p = 0.9 per batch, expected-value derating)"
        meta = {"disconnect_probability": 0.9, "derating": keep}
    return _cluster(_devices("v", 8, V100), vols, dl, bw, dl_u, bw_u, name, meta)


def hps_hybrid_disconnect(seed: int = 0) -> dict:
    """Case 4: case 3 with disconnections."""
    return hps_hybrid(seed, disconnections=True)


def dfm_datacenter(seed: int = 0) -> dict:
    """dfm case 1: 8 nodes of 8 V100; NVLink 150 GB/s inside a node, 25 Gb/s between nodes."""
    rng = np.random.default_rng(seed)
    dl, bw = _sites(rng, [8] * 8, 150 * GBPS, 0.01, (25_000.0, 25_000.0), (DC_DELAY_MS, DC_DELAY_MS), jitter=0.01)
    return _cluster(_devices("v", 64, V100), [], dl, bw, [], [], "dfm case 1: datacenter on demand, 8 x 8 V100")


def dfm_spot(seed: int = 0) -> dict:
    """dfm case 2: 4 nodes of 4 V100 (100 Gb/s inside) and 32 single-V100 nodes; 10 Gb/s between nodes."""
    rng = np.random.default_rng(seed)
    dl, bw = _sites(
        rng, [4] * 4 + [1] * 32, 100_000.0, 0.01, (10_000.0, 10_000.0), (DC_DELAY_MS, DC_DELAY_MS), jitter=0.01
    )
    return _cluster(_devices("v", 48, V100), [], dl, bw, [], [], "dfm case 2: spot instances, 4 x 4 + 32 x 1 V100")


def dfm_multi_dc(seed: int = 0) -> dict:
    """dfm case 3: two organisations of 32 V100; 10 Gb/s inside, 10 ms and 1.12 Gb/s across."""
    rng = np.random.default_rng(seed)
    dl, bw = _sites(rng, [32, 32], 10_000.0, DC_DELAY_MS, (1_120.0, 1_120.0), (10.0, 10.0), jitter=0.01)
    return _cluster(_devices("v", 64, V100), [], dl, bw, [], [], "dfm case 3: two datacenters of 32 V100")


def random_cluster(
    seed: int = 0, n_reliable: int = 8, n_unreliable: int = 16, n_sites: int | None = None, as_arrays: bool = False
) -> dict:
    """Reliable devices in a few sites placed at random (delay 2 + 150 * distance ms between
    sites, 1-10 Gb/s log-uniform; 0.1 ms and 10-40 Gb/s inside one); volunteers at random
    places behind 20-500 Mb/s access links with 5-60 ms of their own. Compute 8-30 TFLOP/s for
    reliable devices, 3-15 for volunteers; memory 16-80 GB and 6-24 GB (a quarter of the
    volunteers without a stated memory)."""
    rng = np.random.default_rng(seed)
    R, U = n_reliable, n_unreliable
    S = n_sites or max(1, min(R // 2, int(rng.integers(1, 6))))
    pos = rng.random((S, 2))
    site = np.sort(rng.integers(0, S, R))
    dist = np.linalg.norm(pos[:, None] - pos[None], axis=-1)
    sdl = 2.0 + 150.0 * dist
    sbw = np.exp(rng.uniform(np.log(1000.0), np.log(10_000.0), (S, S)))
    sbw = np.minimum(sbw, sbw.T)
    np.fill_diagonal(sdl, DC_DELAY_MS)
    np.fill_diagonal(sbw, rng.uniform(10_000.0, 40_000.0, S))
    dl = _sym(rng, sdl[np.ix_(site, site)], 0.05)
    bw = _sym(rng, sbw[np.ix_(site, site)], 0.05)
    rel = [
        {"id": f"s{i}", "tflops": round(float(rng.uniform(8, 30)), 2), "memory_gb": int(rng.integers(16, 81))}
        for i in range(R)
    ]
    vol = []
    for u in range(U):
        v = {"id": f"u{u}", "tflops": round(float(rng.uniform(3, 15)), 2)}
        if rng.random() < 0.75:
            v["memory_gb"] = int(rng.integers(6, 25))
        vol.append(v)
    if U:
        upos = rng.random((U, 2))
        udist = np.linalg.norm(upos[:, None] - pos[site][None], axis=-1)
        dl_u = 2.0 + 150.0 * udist + rng.uniform(5.0, 60.0, (U, 1))
        access = np.exp(rng.uniform(np.log(20.0), np.log(500.0), (U, 1)))
        bw_u = np.minimum(access * rng.uniform(0.8, 1.0, (U, R)), sbw[site][:, site].min())
    else:
        dl_u = bw_u = np.zeros((0, R))
    return _cluster(rel, vol, dl, bw, dl_u, bw_u, f"random cluster {R}+{U} (seed {seed})", as_arrays=as_arrays)


def small_random_cluster(seed: int) -> dict:
    """A random cluster small enough for the exact search: 2-6 reliable, 0-4 volunteers."""
    rng = np.random.default_rng(10_000 + seed)
    return random_cluster(seed, int(rng.integers(2, 7)), int(rng.integers(0, 5)))


def small_model(seed: int) -> dict:
    """A model for small clusters: 4-12 layers, so that splits and stage counts matter."""
    rng = np.random.default_rng(20_000 + seed)
    return {
        "layers": int(rng.integers(4, 13)),
        "hidden": int(rng.choice([1024, 2048, 4096])),
        "bytes_per_value": 2,
        "batch_tokens": 262144,
        "micro_batches": int(rng.choice([16, 64, 128])),
    }


SCENARIOS = {
    "hps1-datacenter": hps_datacenter,
    "hps2-4hpc": hps_hpc4,
    "hps3-hybrid": hps_hybrid,
    "hps4-disconnect": hps_hybrid_disconnect,
    "dfm1-datacenter": dfm_datacenter,
    "dfm2-spot": dfm_spot,
    "dfm3-2dc": dfm_multi_dc,
    "random-64+512": lambda seed=0: random_cluster(seed, 64, 512),
}
