"""Cluster, model and plan files: units, lookups by id, and every malformed case named by field."""

import copy
import json

import numpy as np
import pytest

from scheduler import PlanInputError, load_cluster, load_model, load_plan

CLUSTER = {
    "reliable": [{"id": "s0", "tflops": 14.0, "memory_gb": 16}, {"id": "s1", "tflops": 14.0}],
    "unreliable": [{"id": "u0", "tflops": 9.0}],
    "delay_ms": {"reliable": [[0, 12.0], [12.0, 0]], "unreliable": [[40.0, 55.0]]},
    "bandwidth_mbps": {"reliable": [[0, 1000.0], [1000.0, 0]], "unreliable": [[200.0, 150.0]]},
}
MODEL = {"layers": 24, "hidden": 2048, "bytes_per_value": 2, "batch_tokens": 524288, "micro_batches": 128}


def test_the_spec_example_in_code_units(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(CLUSTER))
    c = load_cluster(str(path))
    assert c.reliable_ids == ["s0", "s1"] and c.unreliable_ids == ["u0"]
    assert c.reliable_flops.tolist() == [14e12, 14e12] and c.unreliable_flops.tolist() == [9e12]
    assert c.reliable_memory == [16e9, None]
    assert c.delay("s0", "s1") == pytest.approx(0.012)
    assert c.bandwidth("s0", "s1") == pytest.approx(125e6)
    assert c.delay("u0", "s1") == c.delay("s1", "u0") == pytest.approx(0.055)
    assert c.bandwidth("s0", "u0") == pytest.approx(25e6)
    assert c.delay("s0", "s0") == 0.0
    with pytest.raises(KeyError):
        c.delay("s0", "nope")
    m = load_model(MODEL)
    assert m.act_bytes_per_token == 4096
    assert m.flops_per_token_per_layer == 72 * 2048**2
    assert m.params_per_layer == 12 * 2048**2
    assert m.tokens_per_micro_batch == 4096
    assert load_model({**MODEL, "flops_per_token_per_layer": 1e9}).flops_per_token_per_layer == 1e9


def test_asymmetric_reliable_links_and_array_input():
    d = copy.deepcopy(CLUSTER)
    d["delay_ms"]["reliable"] = np.array([[0, 5.0], [7.0, 0]])
    c = load_cluster(d)
    assert (c.delay("s0", "s1"), c.delay("s1", "s0")) == (pytest.approx(0.005), pytest.approx(0.007))


def _set(path, value):
    def mutate(d):
        obj = d
        for key in path[:-1]:
            obj = obj[key]
        if value is KeyError:
            del obj[path[-1]]
        else:
            obj[path[-1]] = value

    return mutate


CLUSTER_CASES = [
    (_set(["delay_ms", "reliable", 1], [12.0]), "cluster.delay_ms.reliable[1]: expected 2 values, got 1"),
    (_set(["delay_ms", "reliable"], [[0, 1]]), "cluster.delay_ms.reliable: expected 2 rows, got 1"),
    (_set(["bandwidth_mbps", "reliable", 0, 1], 0), "cluster.bandwidth_mbps.reliable[0][1]: must be positive"),
    (_set(["bandwidth_mbps", "unreliable", 0, 0], -5.0), "cluster.bandwidth_mbps.unreliable[0][0]: must be positive"),
    (_set(["delay_ms", "unreliable", 0, 1], -1), "cluster.delay_ms.unreliable[0][1]"),
    (_set(["delay_ms", "unreliable", 0, 1], "fast"), "cluster.delay_ms.unreliable[0][1]: expected a number"),
    (_set(["delay_ms", "unreliable"], [[1, 2], [3, 4]]), "cluster.delay_ms.unreliable: expected 1 rows, got 2"),
    (_set(["delay_ms", "unreliable"], KeyError), "cluster.delay_ms.unreliable: missing"),
    (_set(["unreliable", 0, "id"], "s1"), "cluster.unreliable[0].id: duplicate id 's1'"),
    (_set(["reliable", 1, "id"], "s0"), "cluster.reliable[1].id: duplicate id 's0'"),
    (_set(["reliable", 1, "tflops"], 0), "cluster.reliable[1].tflops: must be positive"),
    (_set(["reliable", 1, "tflops"], KeyError), "cluster.reliable[1].tflops: missing"),
    (_set(["reliable", 0, "memory_gb"], "lots"), "cluster.reliable[0].memory_gb: expected a number"),
    (_set(["reliable", 0, "memroy_gb"], 3), "cluster.reliable[0].memroy_gb: unknown field"),
    (_set(["reliable"], [{"id": "s0", "tflops": 1}]), "cluster.reliable: at least 2 reliable devices"),
    (_set(["reliable"], KeyError), "cluster.reliable: missing"),
    (_set(["bandwidth_mbps"], KeyError), "cluster.bandwidth_mbps: missing"),
    (_set(["bandwidth_mbps"], [1, 2]), "cluster.bandwidth_mbps: expected an object"),
    (_set(["bandwith_mbps"], {}), "cluster.bandwith_mbps: unknown field"),
    (_set(["unreliable", 0], "u0"), "cluster.unreliable[0]: expected an object"),
]


@pytest.mark.parametrize("mutate, message", CLUSTER_CASES)
def test_malformed_cluster_names_the_field(mutate, message):
    d = copy.deepcopy(CLUSTER)
    mutate(d)
    with pytest.raises(PlanInputError) as e:
        load_cluster(d)
    assert message in str(e.value)


def test_unreadable_files(tmp_path):
    with pytest.raises(PlanInputError, match="cluster: cannot read"):
        load_cluster(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanInputError, match="model: .* is not JSON"):
        load_model(str(bad))
    bad.write_text("[1, 2]")
    with pytest.raises(PlanInputError, match="plan: expected a JSON object"):
        load_plan(str(bad))


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("layers", 0, "model.layers: must be positive"),
        ("layers", 2.5, "model.layers: expected an integer"),
        ("hidden", "big", "model.hidden: expected a number"),
        ("micro_batches", KeyError, "model.micro_batches: missing"),
        ("micro_batches", 10**7, "model.micro_batches"),
        ("flops_per_token_per_layer", -1, "model.flops_per_token_per_layer: must be positive"),
        ("batch_size", 3, "model.batch_size: unknown field"),
    ],
)
def test_malformed_model_names_the_field(key, value, message):
    d = dict(MODEL)
    if value is KeyError:
        del d[key]
    else:
        d[key] = value
    with pytest.raises(PlanInputError) as e:
        load_model(d)
    assert message in str(e.value)


PLAN = {"stages": [{"frontal": ["s0"], "backward": ["s1"], "clients": ["u0"], "layers": [0, 24]}], "idle": []}


@pytest.mark.parametrize(
    "mutate, message",
    [
        (_set(["stages"], []), "plan.stages: expected a non-empty list"),
        (_set(["stages"], KeyError), "plan.stages: missing"),
        (_set(["stages", 0, "frontal", 0], "s9"), "plan.stages[0].frontal[0]: unknown device 's9'"),
        (_set(["stages", 0, "clients", 0], 7), "plan.stages[0].clients[0]: expected a device id"),
        (_set(["stages", 0, "backward"], "s1"), "plan.stages[0].backward: expected a list"),
        (_set(["stages", 0, "layers"], [0]), "plan.stages[0].layers: expected [first, end)"),
        (_set(["stages", 0, "layers"], KeyError), "plan.stages[0].layers: missing"),
        (_set(["stages", 0, "servers"], []), "plan.stages[0].servers: unknown field"),
        (_set(["idle"], ["u7"]), "plan.idle[0]: unknown device 'u7'"),
        (_set(["predicted_seconds_per_batch"], "soon"), "plan.predicted_seconds_per_batch: expected a number"),
    ],
)
def test_malformed_plan_names_the_field(mutate, message):
    d = copy.deepcopy(PLAN)
    mutate(d)
    with pytest.raises(PlanInputError) as e:
        load_plan(d, load_cluster(CLUSTER))
    assert message in str(e.value)


def test_plan_round_trip(tmp_path):
    c = load_cluster(CLUSTER)
    plan = load_plan(PLAN, c)
    plan.predicted_seconds_per_batch = 1.5
    plan.save(tmp_path / "p.json")
    again = load_plan(str(tmp_path / "p.json"), c)
    assert again.to_dict() == plan.to_dict()
    assert json.loads((tmp_path / "p.json").read_text())["predicted_seconds_per_batch"] == 1.5
