"""A second, loop-by-loop reading of docs/cost-model.md ("Cost of a plan"), written from
the spec text with the cluster's delay()/bandwidth() by id and no numpy, to check the
vectorized plan_cost against."""

from __future__ import annotations

from fractions import Fraction


def T(cluster, x, y, n):
    return cluster.delay(x, y) + n / cluster.bandwidth(x, y)


def reference_cost(cluster, model, plan) -> float:
    flops = dict(zip(cluster.reliable_ids, cluster.reliable_flops))
    flops.update(zip(cluster.unreliable_ids, cluster.unreliable_flops))
    m = model.batch_tokens / model.micro_batches
    a = model.hidden * model.bytes_per_value
    F = model.flops_per_token_per_layer
    P = 12 * model.hidden**2
    K = len(plan.stages)
    taus, ags = [], []
    for k, st in enumerate(plan.stages):
        n_k = st.layers[1] - st.layers[0]
        W = list(st.frontal) + list(st.backward) + list(st.clients)
        sigma = sum(flops[w] for w in W)
        comp = m * F * n_k / sigma
        comms = []
        for w in W:
            xa = m * flops[w] / sigma * a
            if w in st.clients:
                c = min(2 * T(cluster, w, f, xa) for f in st.frontal) + min(
                    2 * T(cluster, w, b, xa) for b in st.backward
                )
            elif w in st.frontal:
                c = min(T(cluster, w, b, xa) + T(cluster, b, w, xa) for b in st.backward)
            else:
                c = min(T(cluster, f, w, xa) + T(cluster, w, f, xa) for f in st.frontal)
            comms.append(c)
        dt = comp + max(comms)
        link = 0.0
        if k + 1 < K:
            senders, receivers = st.backward, plan.stages[k + 1].frontal
            p, q = len(senders), len(receivers)
            fw, bw = [], []
            for i, b in enumerate(senders):
                for j, f in enumerate(receivers):
                    lo = max(Fraction(i, p), Fraction(j, q))
                    hi = min(Fraction(i + 1, p), Fraction(j + 1, q))
                    if hi > lo:
                        n = float(hi - lo) * m * a
                        fw.append(T(cluster, b, f, n))
                        bw.append(T(cluster, f, b, n))
            link = max(fw) + max(bw)
        taus.append(dt + link)
        S = list(st.frontal) + list(st.backward)
        g = n_k * P * model.bytes_per_value / len(S)
        for w in W:
            ags.append(sum(T(cluster, w, j, g) + T(cluster, j, w, g) for j in S if j != w))
    pipe = (model.micro_batches + K - 1) * max(taus)
    return max(pipe, max(ags))
