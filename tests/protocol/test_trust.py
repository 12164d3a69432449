"""Signed records (core/protocol/trust.py): what a reader believes, and what it drops with the reason.
Every case here is a forgery an outsider could store in the DHT; the live test is in
tests/swarm/test_trust.py."""

from __future__ import annotations

import time

import msgpack
import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord

from core.protocol import record_store
from core.protocol.trust import (
    SigningKey,
    TrustError,
    config_name,
    key_name,
    open_record,
    peer_id_of,
    seal,
    split_run_id,
    stage_name,
)
from core.protocol.validator import RunValidator

NOW = 1_800_000_000.0
RUN_KEY = SigningKey.generate()
OTHER_RUN_KEY = SigningKey.generate()
SERVER = SigningKey.generate()  # a server's libp2p identity
VOLUNTEER = SigningKey.generate()
OUTSIDER = SigningKey.generate()


def server_body(device="s0f0", stage=0) -> dict:
    return {
        "kind": "server",
        "device": device,
        "role": "frontal",
        "stage": stage,
        "state": "online",
        "version": 3,
        "maddrs": ["/ip4/127.0.0.1/tcp/5"],
        "time": NOW,
    }


def client_body() -> dict:
    return {"kind": "client", "device": "v1", "stage": 0, "state": "online", "compute": 2.0, "time": NOW}


def config_body(steps=100000) -> dict:
    return {
        "run_id": "r",
        "model": "tiny",
        "seed": 0,
        "steps": steps,
        "batch_size": 8,
        "micro_batches": 2,
        "lr": 0.001,
        "layout": {},
        "announce_period": 1.0,
        "arch": None,
    }


def key_kind(body) -> str:
    """The key a record of this body belongs under: its stage's servers' or its volunteers'."""
    return "stage" if isinstance(body, dict) and body.get("kind") == "server" else "clients"


def stage_record(signer, body, run_key=None, subkey=None, run_id="r", ttl=3.0, now=NOW, kind=None):
    subkey = subkey or peer_id_of(signer.public_der)
    name = key_name(run_id, kind or key_kind(body), body["stage"])
    return subkey, seal(name, subkey, body, ttl, signer, run_key=run_key, now=now)


def read_stage(subkey, value, run_fp=RUN_KEY.fingerprint, stage=0, now=NOW + 1, kind=None):
    kind = kind or key_kind(value.get("body") if isinstance(value, dict) else None)
    return open_record("r", kind, stage, subkey, value, run_fp, now=now)


def test_records_signed_as_the_rules_say_are_believed():
    assert read_stage(*stage_record(SERVER, server_body(), RUN_KEY)) == server_body()
    assert read_stage(*stage_record(VOLUNTEER, client_body())) == client_body()
    config = seal(config_name("r"), RUN_KEY.fingerprint, config_body(), 3.0, RUN_KEY, now=NOW)
    assert (
        open_record("r", "config", None, RUN_KEY.fingerprint, config, RUN_KEY.fingerprint, now=NOW + 1) == config_body()
    )


@pytest.mark.parametrize(
    "forge,reason",
    [
        # an outsider re-publishes a live server's record under its own peer id: it has no run key
        (lambda: stage_record(OUTSIDER, server_body()), "run key or signature missing"),
        # ... signed with a run key of its own
        (lambda: stage_record(OUTSIDER, server_body(), OTHER_RUN_KEY), "server record signed by another run key"),
        # ... or under the server's peer id (it cannot sign as that peer)
        (
            lambda: stage_record(OUTSIDER, server_body(), RUN_KEY, subkey=peer_id_of(SERVER.public_der)),
            "signed by another peer's key",
        ),
        # a made-up server s0f9
        (lambda: stage_record(OUTSIDER, server_body("s0f9")), "run key or signature missing"),
        # a volunteer's record that claims a run signature it forged with another key
        (lambda: stage_record(VOLUNTEER, client_body(), OTHER_RUN_KEY), "must not carry a run signature"),
        # a record of another run replayed here (its key name differs, so its signature does not hold)
        (lambda: stage_record(SERVER, server_body(), RUN_KEY, run_id="other"), "bad writer's signature"),
        # a record of stage 1 put under stage 0's key
        (
            lambda: (lambda sk, v: (sk, v))(*stage_record(SERVER, server_body(stage=1), RUN_KEY)),
            "bad writer's signature",
        ),
        # an expired one replayed later, and one dated in the future
        (lambda: stage_record(SERVER, server_body(), RUN_KEY, now=NOW - 100), "expired 98 s ago"),
        (lambda: stage_record(SERVER, server_body(), RUN_KEY, now=NOW + 3600), "s in the future"),
        (lambda: stage_record(SERVER, server_body(), RUN_KEY, ttl=10 * 24 * 3600), "claims a life of"),
    ],
)
def test_forged_stage_records_are_dropped_with_the_reason(forge, reason):
    subkey, value = forge()
    with pytest.raises(TrustError, match=reason.replace("(", r"\(")):
        read_stage(subkey, value)


def test_a_record_under_the_other_key_of_its_stage_is_dropped():
    """A stage's servers' key holds server records only (every peer reads it each announce period:
    a stranger's records there would grow every read), its volunteers' key volunteer records only."""
    subkey, value = stage_record(VOLUNTEER, client_body(), kind="stage")
    with pytest.raises(TrustError, match="a client record under stage 0's servers' key"):
        read_stage(subkey, value, kind="stage")
    subkey, value = stage_record(SERVER, server_body(), RUN_KEY, kind="clients")
    with pytest.raises(TrustError, match="a server record under stage 0's volunteers' key"):
        read_stage(subkey, value, kind="clients")
    with pytest.raises(TrustError, match="unknown key kind"):
        read_stage(subkey, value, kind="servers")


def test_a_tampered_record_fails_its_signature():
    subkey, value = stage_record(SERVER, server_body(), RUN_KEY)
    value["body"] = dict(value["body"], version=99)
    with pytest.raises(TrustError, match="bad writer's signature"):
        read_stage(subkey, value)
    for broken in ({}, {"body": 1}, dict(value, extra=1), dict(value, time=1)):
        with pytest.raises(TrustError):
            read_stage(subkey, broken)


def test_a_forged_config_is_dropped_and_the_run_key_is_learnt_once():
    real = seal(config_name("r"), RUN_KEY.fingerprint, config_body(), 3.0, RUN_KEY, now=time.time())
    # steps 100000 -> 1 under the real fingerprint, signed by another key
    forged = seal(config_name("r"), RUN_KEY.fingerprint, config_body(steps=1), 3.0, OTHER_RUN_KEY, now=time.time())
    with pytest.raises(TrustError, match="bad writer's signature"):
        open_record("r", "config", None, RUN_KEY.fingerprint, dict(real, body=config_body(steps=1)), None)
    with pytest.raises(TrustError, match="stored under its run key's fingerprint"):
        open_record("r", "config", None, RUN_KEY.fingerprint, forged, None)
    trust = record_store.Trust(run_id="r", run_fp=RUN_KEY.fingerprint, identity=VOLUNTEER)
    config, dropped = record_store.open_config(trust, {RUN_KEY.fingerprint: real})
    assert config["steps"] == 100000 and dropped == []
    # a reader without a fingerprint takes the only run key that publishes the run, and keeps it
    own = seal(config_name("r"), OTHER_RUN_KEY.fingerprint, config_body(steps=1), 3.0, OTHER_RUN_KEY, now=time.time())
    tofu = record_store.Trust(run_id="r", run_fp=None, identity=VOLUNTEER)
    config, _ = record_store.open_config(tofu, {RUN_KEY.fingerprint: real})
    assert tofu.run_fp == RUN_KEY.fingerprint
    config, dropped = record_store.open_config(tofu, {RUN_KEY.fingerprint: real, OTHER_RUN_KEY.fingerprint: own})
    assert config["steps"] == 100000 and "config of another run key" in dropped[0][1]
    # ... and refuses to choose between two
    with pytest.raises(ValueError, match="published under 2 run keys"):
        record_store.open_config(
            record_store.Trust(run_id="r", run_fp=None, identity=VOLUNTEER),
            {RUN_KEY.fingerprint: real, OTHER_RUN_KEY.fingerprint: own},
        )


def test_the_validator_drops_and_counts_what_breaks_the_rules():
    """What a DHT node of the run does with a store or an answer: keys of other runs pass."""
    v = RunValidator("r", RUN_KEY.fingerprint)
    key = DHTID.generate(source=stage_name("r", 0)).to_bytes()

    def record(subkey, value, under=key):  # stored as publish() stores it: to expire when its signature does
        return DHTRecord(
            under, DHTProtocol.serializer.dumps(subkey), DHTProtocol.serializer.dumps(value), value["expires"]
        )

    good = stage_record(SERVER, server_body(), RUN_KEY, now=time.time())
    assert v.validate(record(*good))
    forged = stage_record(OUTSIDER, server_body(), now=time.time())
    assert not v.validate(record(*forged))
    assert v.rejected_total == 1 and v.rejected[-1].key == "r_stage0" and "run key" in v.rejected[-1].reason
    # a volunteer's record: under its stage's volunteers' key, never the servers'
    volunteers = DHTID.generate(source=key_name("r", "clients", 0)).to_bytes()
    assert v.validate(record(*stage_record(VOLUNTEER, client_body(), now=time.time()), under=volunteers))
    assert not v.validate(record(*stage_record(VOLUNTEER, client_body(), now=time.time(), kind="stage")))
    assert v.rejected_total == 2 and "a client record under stage 0's servers' key" in v.rejected[-1].reason
    elsewhere = DHTRecord(
        DHTID.generate(source="another-run_stage0").to_bytes(),
        DHTProtocol.serializer.dumps("x"),
        DHTProtocol.serializer.dumps({"anything": 1}),
        NOW,
    )
    assert v.validate(elsewhere)
    junk = DHTRecord(key, DHTProtocol.serializer.dumps("x"), b"\xc1not msgpack", NOW)
    assert not v.validate(junk) and "undecodable" in v.rejected[-1].reason


def test_an_expired_record_passes_the_dht_a_replayed_one_is_counted_and_readers_skip_both():
    """A record at its end of life (the DHT's expiry is the envelope's) is no forgery: the DHT
    passes it, uncounted (the dashboard listed one as malformed; refused, it made hivemind drop the
    whole stage key a node answered with), and readers skip it; the same envelope stored to live on
    is a replay."""
    v = RunValidator("r", RUN_KEY.fingerprint)
    key = DHTID.generate(source=stage_name("r", 0)).to_bytes()
    subkey, value = stage_record(SERVER, server_body(), RUN_KEY, now=time.time() - 10)
    ser = DHTProtocol.serializer.dumps
    assert v.validate(DHTRecord(key, ser(subkey), ser(value), value["expires"]))
    assert v.rejected_total == 0
    assert not v.validate(DHTRecord(key, ser(subkey), ser(value), time.time() + 60))
    assert v.rejected_total == 1 and v.rejected[-1].reason.startswith("replayed: expired")
    trust = record_store.Trust(run_id="r", run_fp=RUN_KEY.fingerprint, identity=VOLUNTEER)
    assert record_store.open_stage(trust, 0, {subkey: value}) == []  # a reader skips it, listing nothing


def test_the_validator_remembers_a_record_that_passed_until_its_envelope_expires(monkeypatch):
    """A DHT node validates the same stored record on every read that reaches it: one that passed is
    answered from memory while its envelope lives (the same bytes, stored with the same expiry), and
    checked again once it has expired, or stored with another expiry (a replay's)."""
    from core.protocol import trust

    v = RunValidator("r", RUN_KEY.fingerprint)
    key = DHTID.generate(source=stage_name("r", 0)).to_bytes()
    ser = DHTProtocol.serializer.dumps
    t0 = time.time()
    subkey, value = stage_record(SERVER, server_body(), RUN_KEY, now=t0)
    record = DHTRecord(key, ser(subkey), ser(value), value["expires"])
    assert v.validate(record)
    opened = []

    def refuse(*args, **kwargs):
        opened.append(args)
        raise TrustError("checked again")

    monkeypatch.setattr(trust, "open_record", refuse)
    assert v.validate(record) and opened == []  # from memory
    assert not v.validate(DHTRecord(key, ser(subkey), ser(value), value["expires"] + 60)) and len(opened) == 1
    monkeypatch.setattr(trust, "dht_now", lambda: value["expires"] + 0.5)
    assert not v.validate(record) and len(opened) == 2  # expired: checked again
    assert v.rejected_total == 2 and v.rejected[-1].reason == "checked again"


@pytest.mark.parametrize(
    "text,parsed", [("demo", ("demo", None)), ("demo@00112233AABBCCDD", ("demo", "00112233aabbccdd"))]
)
def test_run_ids(text, parsed):
    assert split_run_id(text) == parsed


@pytest.mark.parametrize("text", ["", "a b", "demo@", "demo@xyz", "demo@0011223344556677aa", "@0011223344556677"])
def test_bad_run_ids(text):
    with pytest.raises(ValueError):
        split_run_id(text)


def test_a_run_key_file_round_trip(tmp_path):
    key, made = SigningKey.load_or_create(str(tmp_path / "run.key"))
    again, made_again = SigningKey.load_or_create(str(tmp_path / "run.key"))
    assert made and not made_again and again.fingerprint == key.fingerprint
    assert (tmp_path / "run.key").stat().st_mode & 0o077 == 0


def test_remembered_verdicts_never_pass_a_forgery_nor_an_expired_record():
    """Signatures that verified and schema verdicts are remembered (a DHT node re-validates the same
    stored record on every read); what changed bytes, swapped signatures or the clock says still counts."""
    from core.protocol import trust
    from core.protocol.schema import run_schema_validator

    subkey, good = stage_record(SERVER, server_body(), RUN_KEY)
    assert read_stage(subkey, good) == server_body()
    assert read_stage(subkey, good) == server_body()  # answered from the remembered signatures
    tampered = dict(good, body=dict(good["body"], version=4))
    with pytest.raises(TrustError, match="bad writer's signature"):
        read_stage(subkey, tampered)
    _, other = stage_record(SERVER, server_body(device="s0f1"), RUN_KEY)
    with pytest.raises(TrustError, match="bad writer's signature"):
        read_stage(subkey, dict(good, sig=other["sig"]))
    with pytest.raises(trust.Expired):
        read_stage(subkey, good, now=NOW + 10)
    assert len(trust._VERIFIED) <= trust.VERIFIED_CACHE

    schema = run_schema_validator("r")
    key = DHTID.generate(source=stage_name("r", 0)).to_bytes()
    ok = DHTRecord(key, DHTProtocol.serializer.dumps(subkey), DHTProtocol.serializer.dumps(good), NOW + 3)
    extra = DHTRecord(
        key, DHTProtocol.serializer.dumps(subkey), DHTProtocol.serializer.dumps(dict(good, extra=1)), NOW + 3
    )
    for _ in range(2):  # the second round is answered from the remembered verdicts
        assert schema.validate(ok) and not schema.validate(extra)


def test_remembered_verdicts_hold_digests_not_the_records():
    """A verdict is remembered under the SHA-256 of the bytes it is about, not the bytes: a full cache
    of 4,096 server records (each kilobytes) held them all, megabytes per process, filling in a
    swarm's first minutes (seen as RSS growth in the soak)."""
    from core.protocol import trust
    from core.protocol.schema import run_schema_validator

    subkey, good = stage_record(SERVER, server_body(), RUN_KEY)
    read_stage(subkey, good)
    record_bytes = len(msgpack.packb(good))
    assert record_bytes > 1000
    assert trust._VERIFIED._items and all(isinstance(k, bytes) and len(k) == 32 for k in trust._VERIFIED._items)
    schema = run_schema_validator("r")
    key = DHTID.generate(source=stage_name("r", 0)).to_bytes()
    record = DHTRecord(key, DHTProtocol.serializer.dumps(subkey), DHTProtocol.serializer.dumps(good), NOW + 3)
    assert schema.validate(record) and schema.validate(record)
    assert [len(k) for k in schema._verdicts._items] == [32]
    # the digest binds every part and where each ends: moving a byte across a boundary changes it
    assert trust.digest(b"ab", b"c") != trust.digest(b"a", b"bc")


def test_a_genuine_record_stored_to_outlive_its_signature_is_refused_while_still_valid():
    """A replayer copies a live server's record and stores it with a DHT expiry far past the signed one:
    refused at once (a node keeps the entry that expires last per subkey, so it would shadow the
    server's fresh announcements and, once its signature ran out, hide the stage)."""
    v = RunValidator("r", RUN_KEY.fingerprint)
    key = DHTID.generate(source=stage_name("r", 0)).to_bytes()
    subkey, value = stage_record(SERVER, server_body(), RUN_KEY, now=time.time(), ttl=30.0)
    ser = DHTProtocol.serializer.dumps
    assert v.validate(DHTRecord(key, ser(subkey), ser(value), value["expires"]))
    assert not v.validate(DHTRecord(key, ser(subkey), ser(value), value["expires"] + 900))
    assert v.rejected[-1].reason.startswith("outlives its signature")


def test_one_unusable_entry_under_a_key_does_not_hide_the_others():
    """hivemind refuses a node's whole answer for a key when one entry of its map fails: the run's
    nodes drop that entry and keep the others (validator.keep_valid_entries)."""
    from hivemind.dht.storage import DictionaryDHTValue

    from core.protocol.validator import keep_valid_entries

    keep_valid_entries()
    protocol = DHTProtocol.__new__(DHTProtocol)  # (only its validator and serializer are used)
    protocol.record_validator = RunValidator("r", RUN_KEY.fingerprint)
    key = DHTID.generate(source=stage_name("r", 0)).to_bytes()
    ser = DHTProtocol.serializer.dumps
    now = time.time()
    good_sub, good = stage_record(SERVER, server_body(), RUN_KEY, now=now, ttl=30.0)
    stale_sub, stale = stage_record(VOLUNTEER, client_body(), now=now - 40, ttl=30.0)  # signed expiry passed
    forged_sub, forged = stage_record(OUTSIDER, server_body("s0f9"), OUTSIDER, now=now, ttl=30.0)
    answer = DictionaryDHTValue()
    answer.store(good_sub, ser(good), good["expires"])
    answer.store(stale_sub, ser(stale), now + 600)  # a replay stored to live on
    answer.store(forged_sub, ser(forged), forged["expires"])
    assert protocol._validate_dictionary(key, answer)
    assert [k for k, _ in answer.items()] == [good_sub]
    only_bad = DictionaryDHTValue()
    only_bad.store(forged_sub, ser(forged), forged["expires"])
    assert not protocol._validate_dictionary(key, only_bad)
