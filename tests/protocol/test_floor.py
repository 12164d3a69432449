"""The shared floor: wire format, DHT record schema, row arithmetic, the request log."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import torch
from hivemind.proto.runtime_pb2 import ExpertRequest

from core.layout import RunLayout, owners, segment, split_by_weights
from core.protocol.fields import check_tensor
from core.protocol.records import RunConfig, validate_record
from core.protocol.wire import PayloadError, StreamCut, pack, unpack
from parameter_server.requestlog import RequestLog, read_log


async def _aiter(items):
    for x in items:
        yield x


def test_pack_unpack_roundtrip_streams_tensors_above_the_unary_cap():
    big = torch.randn(3, 1024, 1024)  # 12 MiB: far above hivemind's 4 MiB unary cap
    ids = torch.arange(10)
    messages = pack({"task": "F0.0.0.0-1", "rows": [0, 3]}, [big, ids], ExpertRequest)
    assert all(m.ByteSize() < 4 * 2**20 for m in messages)
    meta, tensors = asyncio.run(unpack(_aiter(messages)))
    assert meta == {"task": "F0.0.0.0-1", "rows": [0, 3]}
    assert torch.equal(tensors[0], big) and torch.equal(tensors[1], ids)


def _tensors_of(messages) -> list:
    """The tensors of `pack`'s messages as hivemind itself reads them back (its chunk joining and
    deserialization), not through `unpack`."""
    from hivemind.compression import deserialize_torch_tensor
    from hivemind.utils.streaming import combine_from_streaming

    groups = []
    for m in messages:
        for part in m.tensors:
            if part.dtype:  # a tensor's first part
                groups.append([part])
            else:
                groups[-1].append(part)
    return [deserialize_torch_tensor(combine_from_streaming(g)) for g in groups]


def _as_hivemind_packs(meta: dict, tensors: list) -> list:
    """What `pack` sent before it cut parts from the tensors' memory: hivemind's serialization, split
    with hivemind's split_for_streaming, one part to a message."""
    from hivemind.compression import serialize_torch_tensor
    from hivemind.utils.streaming import split_for_streaming

    messages = [ExpertRequest(metadata=msgpack.packb(dict(meta, n_tensors=len(tensors))))]
    for t in tensors:
        messages += [ExpertRequest(tensors=[part]) for part in split_for_streaming(serialize_torch_tensor(t), 1 << 20)]
    return messages


WIRE_CASES = [
    torch.randn(3, 600, 700),
    torch.arange(10),
    torch.tensor(2.5),
    torch.zeros(0, 4),
    torch.randn(5).half(),
    torch.tensor([True, False]),
    torch.randint(-9, 9, (4, 3), dtype=torch.int8),
    torch.randn(7).to(torch.bfloat16),
    torch.randn(4, 4).t(),
    torch.randn(300_000, dtype=torch.float64),
]


@pytest.mark.parametrize("t", WIRE_CASES, ids=lambda t: f"{str(t.dtype)[6:]}{list(t.shape)}")
def test_the_wire_is_hivemind_serialization_both_ways(t):
    """`pack` cuts an uncompressed tensor's parts straight from its memory and `unpack` copies them
    straight into the tensor it returns; the bytes are still hivemind's: hivemind reads what `pack`
    sends, and `unpack` reads what hivemind's own serialization and streaming split send."""
    messages = pack({"k": 1}, [t], ExpertRequest)
    assert all(m.ByteSize() <= (1 << 20) + 1024 for m in messages)
    (back,) = _tensors_of(messages)
    assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
    meta, (ours,) = asyncio.run(unpack(_aiter(messages)))
    assert meta == {"k": 1} and ours.dtype == t.dtype and torch.equal(ours, t)
    meta, (theirs,) = asyncio.run(unpack(_aiter(_as_hivemind_packs({"k": 1}, [t]))))
    assert theirs.dtype == t.dtype and torch.equal(theirs, t)
    if t.numel():
        ours.view(-1)[0] = 0  # the tensor unpack returns owns its memory: writable, not a view of a message
        assert torch.equal(_tensors_of(messages)[0], t)


@pytest.mark.parametrize(
    "messages,problem",
    [
        ([], "empty request"),
        ([ExpertRequest(metadata=b"\xc1")], "not valid msgpack"),
        ([ExpertRequest(metadata=msgpack.packb([1, 2]))], "must be a map"),
        ([ExpertRequest(metadata=msgpack.packb({"n_tensors": "2"}))], "'n_tensors' must be a count"),
        (
            [ExpertRequest(metadata=msgpack.packb({"n_tensors": 0}))] + pack({}, [torch.zeros(2)], ExpertRequest)[1:],
            "declares 0 tensors, 1 arrived",
        ),
    ],
)
def test_unpack_refuses_malformed_requests(messages, problem):
    with pytest.raises(PayloadError, match=problem):
        asyncio.run(unpack(_aiter(messages)))


def test_a_stream_that_ends_or_stalls_before_its_last_tensor_is_a_cut_connection():
    """What the caller of a call whose answer was cut short sees: StreamCut, a ConnectionError (so
    P2PLink tries again), never a payload error that would blame the request."""
    # (two dtypes: uncompressed fp32 tensors alone would travel as one, wire.FLAT)
    messages = pack({"x": 1}, [torch.zeros(3), torch.arange(2)], ExpertRequest)
    assert len(messages) == 2  # the metadata, then both tensors in one message
    with pytest.raises(StreamCut, match="ended after 0 of the 2 tensors") as cut:
        asyncio.run(unpack(_aiter(messages[:1])))
    assert cut.value.meta == {"x": 1}  # what did arrive: a cut `take` answer names the leased task

    async def stalls():
        yield messages[0]
        await asyncio.sleep(30)
        yield messages[1]

    with pytest.raises(StreamCut, match="stalled for 0 s after 1 messages") as cut:
        asyncio.run(unpack(stalls(), stall=0.2))
    assert cut.value.meta == {"x": 1}
    assert issubclass(StreamCut, ConnectionError)
    flat = pack({"x": 1}, [torch.zeros(3), torch.ones(2)], ExpertRequest)
    with pytest.raises(StreamCut, match="ended after 0 of the 1 tensors") as cut:
        asyncio.run(unpack(_aiter(flat[:1])))
    assert cut.value.meta == {"x": 1}  # the shapes the tensors would have had are not the caller's


def test_unpack_refuses_oversized_payloads():
    messages = pack({}, [torch.zeros(1000)], ExpertRequest)
    with pytest.raises(PayloadError, match="exceeds 100 bytes"):
        asyncio.run(unpack(_aiter(messages), max_bytes=100))


def test_check_tensor_names_the_problem():
    with pytest.raises(PayloadError, match="x: expected shape"):
        check_tensor(torch.zeros(2, 3), "x", (2, 4), torch.float32)
    with pytest.raises(PayloadError, match="x: expected dtype"):
        check_tensor(torch.zeros(2, 4, dtype=torch.float64), "x", (2, 4), torch.float32)
    with pytest.raises(PayloadError, match="NaN"):
        check_tensor(torch.tensor([1.0, float("nan")]), "x", (2,), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_all_finite_agrees_with_isfinite_everywhere(dtype):
    """The finiteness check of every payload reads a tensor's extremes: a NaN or an infinity of either
    sign anywhere (first, last, inside a transposed view, in a 0-dim tensor) is found, an empty tensor
    and large finite values pass."""
    from core.protocol.fields import all_finite

    gen = torch.Generator().manual_seed(0)
    assert all_finite(torch.empty(0, 3, dtype=dtype))
    big = torch.finfo(dtype).max
    assert all_finite(torch.tensor([big, -big], dtype=dtype))
    for bad in (float("nan"), float("inf"), -float("inf")):
        for shape in ((), (7,), (5, 6)):
            for at in (0, -1):
                t = torch.randn(shape, generator=gen).to(dtype)
                assert all_finite(t)
                t.view(-1)[at] = bad
                assert not all_finite(t) and not bool(torch.isfinite(t).all()), (bad, shape, at)
        view = torch.randn(6, 9, generator=gen).to(dtype).t()
        view[4, 2] = bad
        assert not view.is_contiguous() and not all_finite(view)


def test_records_that_do_not_fit_the_schema_are_named():
    good = {"kind": "client", "device": "v0", "stage": 0, "state": "online", "compute": 3.0, "time": 1.0}
    assert validate_record(good) is good
    for bad, problem in [
        ("x", "expected a map"),
        (dict(good, kind="ghost"), "unknown record kind"),
        (dict(good, stage="0"), "'stage' has the wrong type"),
        (dict(good, state="asleep"), "state"),
        ({k: v for k, v in good.items() if k != "compute"}, "missing field 'compute'"),
    ]:
        with pytest.raises(ValueError, match=problem):
            validate_record(bad)
    with pytest.raises(ValueError, match="missing field 'model'"):
        RunConfig.from_dict({"run_id": "r"})


def test_row_arithmetic():
    assert [segment(10, 3, i) for i in range(3)] == [(0, 3), (3, 6), (6, 10)]
    assert owners(8, 2, 3, 6) == [(0, 3, 4), (1, 4, 6)]
    assert split_by_weights(0, 4, [1, 1, 2]) == [(0, 0, 1), (1, 1, 2), (2, 2, 4)]
    assert split_by_weights(0, 2, [1, 1, 1, 1]) == [(0, 0, 1), (1, 1, 2)]  # fewer rows than clients
    pieces = split_by_weights(5, 105, [3.0, 1.0])
    assert pieces == [(0, 5, 80), (1, 80, 105)]


def test_layout_from_plan_checks_the_tiling():
    plan = {
        "stages": [
            {"frontal": ["a"], "backward": ["b"], "clients": ["u"], "layers": [0, 2]},
            {"frontal": ["c"], "backward": ["d"], "layers": [2, 4]},
        ]
    }
    layout = RunLayout.from_dict(plan, 4)
    assert layout.locate("d") == (1, "backward", 0) and layout.stage_of_client("u") == 0
    with pytest.raises(ValueError, match="layers end at 4, the model has 6"):
        RunLayout.from_dict(plan, 6)
    plan["stages"][1]["layers"] = [3, 4]
    with pytest.raises(ValueError, match=r"stages\[1\].layers"):
        RunLayout.from_dict(plan, 4)


def test_request_log_survives_a_torn_tail_and_compacts(tmp_path):
    path = str(tmp_path / "s.log")
    log = RequestLog(path)
    for t in range(4):
        log.append({"method": "push_grads", "batch": t}, [torch.full((2,), float(t))])
    log.compact(2)
    log.append({"method": "push_grads", "batch": 4}, [torch.ones(2)])
    log.compact(3)
    with open(log.segment, "ab") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00partial")  # a crash mid-write
    entries = read_log(path)
    assert [r["batch"] for r, _ in entries] == [3, 4]
    assert torch.equal(entries[0][1][0], torch.full((2,), 3.0))
    restarted, replayed = RequestLog.resume(path)  # a restart replays what lives, appends after the torn record
    assert [r["batch"] for r, _ in replayed] == [3, 4]
    restarted.append({"method": "push_grads", "batch": 5})
    assert [r["batch"] for r, _ in read_log(path)] == [3, 4, 5]


def test_the_request_log_forgets_without_rewriting_what_it_keeps(tmp_path):
    """Compacting at every step deletes whole old segments and writes no kept record again: the
    bytes on disk stay those of the live records (plus the markers), however long the run."""
    import os

    from parameter_server.requestlog import segments

    path = str(tmp_path / "s.log")
    log = RequestLog(path)
    written = 0
    for step in range(30):
        for _ in range(3):  # a step's pushes concern its batch and the one before (delayed updates)
            for batch in (step, step + 1):
                log.append({"method": "push_grads", "batch": batch}, [torch.full((256,), float(step))])
        log.compact(step - 1)
        written = sum(os.path.getsize(p) for p in segments(path))
        files = segments(path)
        assert len(files) <= 4, files
    kept = read_log(path)
    assert sorted({r["batch"] for r, _ in kept}) == [28, 29, 30]
    assert written < 3 * len(kept) * 1200, written  # a record is ~1.1 kB: nothing held twice, no old batch
    before = {p: (os.stat(p).st_ino, os.path.getsize(p)) for p in segments(path)}
    log.compact(29)  # batch 28 goes: its oldest segment is deleted, the others stay as they were
    after = segments(path)
    assert len(after) == len(before) and after[-1] not in before and list(before)[0] not in after
    for p in after[:-2]:
        assert (os.stat(p).st_ino, os.path.getsize(p)) == before[p], p
    assert [r["batch"] for r, _ in read_log(path)][:1] == [29]


def test_request_log_records_come_back_bit_for_bit_and_a_log_written_before_still_reads(tmp_path):
    """Every dtype a request may carry (fp32, and what a compressed run's activations arrive as),
    scalars and empty tensors come back with their dtype, shape and bits; a log of torch.save blobs
    (the format before) is read as it is, and appending to it keeps both readable."""
    import io
    import struct

    gen = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3, 4, generator=gen),
        torch.randn(5, generator=gen).to(torch.bfloat16),
        torch.randn(2, 2, generator=gen).half(),
        torch.arange(6).reshape(2, 3),
        torch.tensor([True, False]),
        torch.tensor(2.5),
        torch.empty(0, 7),
        torch.randn(4, 4, generator=gen).t(),
    ]
    record = {
        "method": "push_outputs",
        "meta": {"task": "F1.0.0.0-1", "rows": [0, 1], "x": b"\x00\xff"},
        "sender": "Qm" * 20,
        "batch": 1,
    }
    path = tmp_path / "s.log"
    old = io.BytesIO()
    torch.save({"record": {"method": "complete", "batch": 0}, "tensors": [torch.ones(2)]}, old)
    path.write_bytes(struct.pack("<Q", len(old.getvalue())) + old.getvalue())
    log = RequestLog(str(path))
    log.append(record, tensors)
    entries = read_log(str(path))
    assert [r["method"] for r, _ in entries] == ["complete", "push_outputs"]
    assert torch.equal(entries[0][1][0], torch.ones(2))
    assert entries[1][0] == record
    for got, want in zip(entries[1][1], tensors, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), want.dtype


def test_a_malformed_push_for_an_applied_batch_is_still_an_error():
    """A late gradient for a batch already applied is a counted duplicate, but only if it is well
    formed: a wrong shape, dtype or NaN is refused with the reason, whatever the batch."""
    from parameter_server.shard import ShardState

    shard = ShardState({"w": torch.zeros(2, 3)}, lr=1e-3, rows_per_micro=2, micro_batches=1, steps=4)
    one = [("B0.0.0.0-2", 0, (0, 2))]
    assert shard.credit(batch=0, pieces=one, grads=[torch.ones(2, 3)]) == ("credited", [])
    assert shard.ready_to_step() and shard.step() == 1
    assert shard.credit(batch=0, pieces=one, grads=[torch.ones(2, 3)]) == ("duplicate", ["B0.0.0.0-2"])
    assert shard.duplicates == 1
    bad = {
        "shape": [torch.ones(3, 2)],
        "dtype": [torch.ones(2, 3, dtype=torch.float64)],
        "NaN": [torch.full((2, 3), float("nan"))],
        "gradient tensors": [torch.ones(2, 3)] * 2,
    }
    for words, grads in bad.items():
        with pytest.raises(PayloadError, match=words):
            shard.credit(batch=0, pieces=one, grads=grads)
    with pytest.raises(PayloadError, match="rows"):
        shard.credit(batch=0, pieces=[("B0.0.0.0-5", 0, (0, 5))], grads=[torch.ones(2, 3)])
    assert shard.duplicates == 1 and shard.version == 1


def test_an_accumulated_push_is_credited_all_or_nothing():
    """A push summed over several tasks is credited whole; one that overlaps credited tasks only in
    part is a conflict that changes nothing and names the tasks already credited; one whose tasks
    are all credited is a duplicate; overlapping rows inside one push are an error."""
    from core.protocol.tasks import TaskId
    from parameter_server.shard import ShardState

    shard = ShardState({"w": torch.zeros(3)}, lr=1e-1, rows_per_micro=4, micro_batches=2, steps=2)
    ref = ShardState({"w": torch.zeros(3)}, lr=1e-1, rows_per_micro=4, micro_batches=2, steps=2)

    def pieces(*ids):
        return [(tid, TaskId.parse(tid).micro, TaskId.parse(tid).rows) for tid in ids]

    g = {
        tid: torch.tensor([1.0, 2.0, 3.0]) * (i + 1) for i, tid in enumerate(["B0.0.0.0-2", "B0.0.0.2-4", "B0.1.0.0-4"])
    }
    assert shard.credit(
        batch=0, pieces=pieces("B0.0.0.0-2", "B0.1.0.0-4"), grads=[g["B0.0.0.0-2"] + g["B0.1.0.0-4"]]
    ) == ("credited", [])
    # another client's sum covers one credited task and one new one: nothing changes
    before = shard.batches[0].grads["w"].clone()
    assert shard.credit(batch=0, pieces=pieces("B0.0.0.2-4", "B0.1.0.0-4"), grads=[torch.ones(3)]) == (
        "conflict",
        ["B0.1.0.0-4"],
    )
    assert torch.equal(shard.batches[0].grads["w"], before) and not shard.ready_to_step()
    assert shard.credit(batch=0, pieces=pieces("B0.1.0.0-4"), grads=[torch.ones(3)]) == ("duplicate", ["B0.1.0.0-4"])
    with pytest.raises(PayloadError, match="overlap"):
        shard.credit(batch=0, pieces=pieces("B0.0.0.2-4", "B0.0.0.3-4"), grads=[torch.ones(3)])
    with pytest.raises(PayloadError, match="overlap"):  # rows [1, 3) cut across credited rows [0, 2)
        shard.credit(batch=0, pieces=pieces("B0.0.0.1-3"), grads=[torch.ones(3)])
    assert shard.credit(batch=0, pieces=pieces("B0.0.0.2-4"), grads=[g["B0.0.0.2-4"]]) == ("credited", [])
    assert shard.ready_to_step() and shard.step() == 1
    for tid, grad in g.items():  # the same update as crediting each task alone
        ref.credit(batch=0, pieces=pieces(tid), grads=[grad])
    ref.step()
    assert torch.allclose(shard.params["w"], ref.params["w"])
    for bad in ["X0.0.0.0-2", "B0.0.0.0", 7, "B0.0.0.0-2 "]:
        with pytest.raises(PayloadError, match="malformed task id"):
            TaskId.parse(bad)


def test_a_failover_layout_moves_slots_and_keeps_roles_filled():
    from core.layout import RunLayout

    layout = RunLayout.even(2, 4, 2, 2)
    assert layout.stages[0].hosts == ("s0f0", "s0f1", "s0b0", "s0b1")
    new = layout.without({"s0f0": "s0f1"})
    st = new.stages[0]
    assert st.frontal == ("s0f1",) and st.hosts == ("s0f1", "s0f1", "s0b0", "s0b1") and st.slots_of("s0f1") == [0, 1]
    assert new.stages[1] == layout.stages[1]
    assert RunLayout.from_dict(new.to_dict(), 4) == new  # the epoch record round-trips
    with pytest.raises(ValueError, match="no frontal server left"):
        new.without({"s0f1": "s0b0"})
    with pytest.raises(ValueError, match="remaining server of the stage"):
        layout.without({"s0b1": "s1f0"})
    # the losses a failover cannot absorb: a role left with no server
    assert layout.stranded(["s0f0"]) == [] and new.stranded(["s0b0"]) == []
    assert new.stranded(["s0f1", "s1b0", "s1b1"]) == [(0, "frontal", ("s0f1",)), (1, "backward", ("s1b0", "s1b1"))]
    bad = new.to_dict()
    bad["stages"][0]["shard_hosts"] = ["s0f1", "s0f1", "s0b0", "s1b1"]
    with pytest.raises(ValueError, match="shard_hosts"):
        RunLayout.from_dict(bad, 4)


def test_a_replica_takes_the_shards_state_or_refuses_and_changes_nothing():
    """After each step a server copies its shard (parameters, AdamW moments and step counts) to the
    next server of its stage; the copy steps on exactly like the original."""
    from parameter_server.shard import ShardState

    def shard():
        return ShardState(
            {"w": torch.zeros(3), "b": torch.ones(2)}, lr=1e-1, rows_per_micro=1, micro_batches=1, steps=4
        )

    owner, replica = shard(), shard()
    grads = {0: [torch.tensor([1.0, 2.0]), torch.tensor([1.0, -1.0, 0.5])], 1: [torch.ones(2), torch.ones(3)]}
    owner.credit(batch=0, pieces=[("B0.0.0.0-1", 0, (0, 1))], grads=grads[0])
    owner.step()
    meta, tensors = owner.export()
    for words, bad in {
        "NaN": [torch.full_like(t, float("nan")) for t in tensors],
        "expected float32": [t.double() for t in tensors],
        "carries": tensors[:-1],
    }.items():
        with pytest.raises(PayloadError, match=words):
            replica.absorb(meta, bad)
    with pytest.raises(PayloadError, match="another shard"):
        replica.absorb(dict(meta, names=["x"]), tensors)
    assert replica.version == 0 and torch.equal(replica.params["w"], torch.zeros(3))
    assert replica.absorb(meta, tensors) and not replica.absorb(meta, tensors)  # only a newer state is taken
    for s in (owner, replica):
        s.credit(batch=1, pieces=[("B1.0.0.0-1", 0, (0, 1))], grads=grads[1])
        s.step()
    assert replica.version == owner.version == 2
    for n in owner.names:
        assert torch.equal(replica.params[n], owner.params[n])
        assert torch.equal(replica.params_at(1)[n], owner.params_at(1)[n])


def test_a_replica_can_be_sent_every_kept_version_in_order():
    """Steps can come faster than the copies: the sender then sends each kept version, oldest first,
    from the shard's history, so the replica holds the version before its newest (a takeover at
    version v re-runs batch v on version v - 1). An export of a version no longer kept is refused."""
    from parameter_server.shard import ShardState

    def shard():
        return ShardState({"w": torch.zeros(3)}, lr=1e-1, rows_per_micro=1, micro_batches=1, steps=8, keep_versions=3)

    owner, replica = shard(), shard()
    for t in range(4):
        owner.credit(batch=t, pieces=[(f"B{t}.0.0.0-1", 0, (0, 1))], grads=[torch.tensor([1.0, -2.0, 0.5]) * (t + 1)])
        owner.step()
    with pytest.raises(PayloadError, match="no longer kept"):
        owner.export(1)
    for v in (2, 3, 4):
        meta, tensors = owner.export(v)
        assert (
            meta["version"] == v
            and meta["microbatches_applied"] == v
            and sorted(map(int, meta["losses"])) == sorted(k for k in owner.losses if k < v)
        )
        assert replica.absorb(meta, tensors)
    assert replica.version == 4 and torch.equal(replica.params["w"], owner.params["w"])
    assert torch.equal(replica.params_at(3)["w"], owner.params_at(3)["w"])  # what re-running batch 4 needs
    for s in (owner, replica):  # and both step on alike
        s.credit(batch=4, pieces=[("B4.0.0.0-1", 0, (0, 1))], grads=[torch.ones(3)])
        s.step()
    assert torch.equal(replica.params["w"], owner.params["w"])


def test_a_versions_digest_is_its_parameters_bits_and_follows_a_rollback():
    """ShardState.digest: a replica kept by steps has its host's digest at every version it mirrors
    (the same bits); another version, or the same version re-made after a rollback with other
    contents, has another; a version not kept has none."""
    from parameter_server.shard import ShardState

    def shard():
        return ShardState(
            {"w": torch.zeros(3), "b": torch.ones(2)},
            lr=1e-1,
            rows_per_micro=1,
            micro_batches=1,
            steps=6,
            keep_versions=4,
        )

    owner, replica = shard(), shard()
    assert replica.absorb(*owner.export(0))
    for t in range(3):
        owner.credit(
            batch=t,
            pieces=[(f"B{t}.0.0.0-1", 0, (0, 1))],
            grads=[torch.tensor([1.0, -2.0]) * (t + 1), torch.tensor([0.5, 1.0, -1.0])],
        )
        owner.step()
        assert replica.absorb_step(*owner.export_step(t + 1))
    digests = [owner.digest(v) for v in range(4)]
    assert [replica.digest(v) for v in range(4)] == digests and len(set(digests)) == 4
    assert all(len(d) == 64 for d in digests) and owner.digest(7) is None
    assert owner.rollback(1, epoch=1)
    assert owner.digest(1) == digests[1] and owner.digest(2) is None
    owner.credit(batch=1, pieces=[("B1.0.0.0-1", 0, (0, 1))], grads=[torch.ones(2), torch.ones(3)])  # other work
    owner.step()
    assert owner.version == 2 and owner.digest(2) not in (None, digests[2])


def test_a_task_id_formats_and_parses_in_one_place():
    from core.protocol.tasks import TaskId, batch_of, task_id

    tid = task_id("backward", 3, 1, 0, (4, 8))
    assert tid == "B3.1.0.4-8"
    assert TaskId.parse(tid) == TaskId("backward", 3, 1, 0, (4, 8)) and str(TaskId.parse(tid)) == tid
    assert batch_of("F12.0.1.0-4") == 12 and batch_of("nonsense") is None and batch_of(None) is None


def test_the_method_table_is_what_the_server_offers():
    from core.protocol import methods
    from parameter_server.parts import PART_HANDLERS
    from parameter_server.service import StageServer

    for name in methods.NAMES:
        owner = PART_HANDLERS[name][1] if name in PART_HANDLERS else StageServer
        assert hasattr(StageServer, f"rpc_{name}") and hasattr(owner, f"on_{name}"), name
    offered = {n[len("on_") :] for n in dir(StageServer) if n.startswith("on_")}
    assert not offered & set(PART_HANDLERS) and offered | set(PART_HANDLERS) == set(methods.NAMES)
    assert methods.NOT_RETRIED == {"take"}
    assert methods.SERVER_ONLY == {
        "push_inputs",
        "push_output_grads",
        "push_replica",
        "adopt_epoch",
        "get_held",
        "report_cheat",
        "ban",
        "pin",
        "requeue_missing",
        "grad_norm",
        "eval_forward",
    }


def test_a_pin_keeps_versions_beyond_the_window_up_to_its_bound():
    """A shard keeps keep_versions versions, and those from its pin on (a volunteer on probation whose
    ban would roll back there) up to PIN_EXTRA x keep_versions more; unpinned, the window alone."""
    from parameter_server.shard import PIN_EXTRA, ShardState

    shard = ShardState({"w": torch.zeros(3)}, lr=1e-2, rows_per_micro=1, micro_batches=1, steps=40, keep_versions=3)

    def step_to(version):
        while shard.version < version:
            t = shard.version
            shard.credit(batch=t, pieces=[(f"B{t}.0.0.0-1", 0, (0, 1))], grads=[torch.ones(3)], loss_sum=1.0)
            shard.step()

    shard.pinned_from = 2
    step_to(8)
    assert shard.kept_from() == 2 and sorted(shard.snapshots) == list(range(2, 9))
    step_to(12)  # the bound: versions more than (1 + PIN_EXTRA) x keep_versions old go
    assert shard.kept_from() == 12 - (1 + PIN_EXTRA) * 3 + 1 == 4
    shard.pinned_from = None
    step_to(13)
    assert shard.kept_from() == 11 and sorted(shard.moments) == [11, 12, 13]


def test_a_shard_keeps_a_bounded_loss_history(monkeypatch):
    """A shard's loss history travels in every replica export and checkpoint: it keeps the last
    LOSS_HISTORY batches, so a run of days does not grow them by a line per step; a replica or a
    checkpoint written with a longer history is cut to the same bound when loaded."""
    import parameter_server.shard as shard_mod
    from parameter_server.shard import ShardState

    monkeypatch.setattr(shard_mod, "LOSS_HISTORY", 5)
    shard = ShardState({"w": torch.zeros(3)}, lr=1e-2, rows_per_micro=1, micro_batches=1, steps=20, keep_versions=3)
    for t in range(12):
        assert shard.credit(
            batch=t, pieces=[(f"B{t}.0.0.0-1", 0, (0, 1))], grads=[torch.ones(3)], loss_sum=float(t)
        ) == ("credited", [])
        shard.step()
    assert shard.losses == {t: float(t) for t in range(7, 12)}
    meta, tensors = shard.export()
    assert sorted(map(int, meta["losses"])) == list(range(7, 12))
    state = shard.state_dict()
    state["losses"] = {str(t): float(t) for t in range(12)}  # written by a server without the bound
    meta["losses"] = dict(state["losses"])
    again = ShardState({"w": torch.zeros(3)}, lr=1e-2, rows_per_micro=1, micro_batches=1, steps=20, keep_versions=3)
    again.load_state_dict(state)
    assert sorted(again.losses) == list(range(7, 12)) and again.version == 12
    replica = ShardState({"w": torch.zeros(3)}, lr=1e-2, rows_per_micro=1, micro_batches=1, steps=20, keep_versions=3)
    assert replica.absorb(meta, tensors)
    assert sorted(replica.losses) == list(range(7, 12))
