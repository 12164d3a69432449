"""Who may write what in a run's DHT records, and how every reader checks it.

The trust root is the run key: an RSA key that the run's reliable servers share (`--run-key PATH`,
made by the first server or `peer keygen`). Its fingerprint (16 hex digits of the SHA-256 of its
public key) is what a volunteer holds, as `--run-id NAME@FINGERPRINT`. Every value of a run's keys is
an envelope:

    {"body": the record, "time": when it was made, "expires": when it stops counting,
     "signer": the writer's public key (DER), "sig": its signature,
     "run_key": the run's public key (DER) or None, "run_sig": the run key's signature or None}

over the same bytes: msgpack of [key name, subkey, body, time, expires]. The key name carries the run
id, so a record of another run (or another key) does not verify here.

- `{run}_config`, subkey the run key's fingerprint: the run's config, signed by the run key itself
  (signer == run key).
- `{run}_stage{k}`, subkey a peer id: that peer's record. `signer` must be the peer's own libp2p
  identity key (its peer id is the hash of it, which libp2p authenticates on every connection), so a
  peer can write only its own record. A server record must also be signed by the run key; a client
  record must not claim it.

`RunValidator` (core/protocol/validator.py) applies these rules inside every DHT node of the run (hivemind's record-validator
hook, beside a `SchemaValidator` for the envelope's shape): a store or an answer that breaks them
is dropped and counted, with the reason at `-v`. Readers check again with `open_record`, which
also holds a record to the fingerprint the reader trusts.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
from typing import Any

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from core.protocol.runid import FINGERPRINT_LEN, split_run_id  # noqa: F401  (re-exported)

logger = logging.getLogger("hivepipe.trust")

MAX_STAGES = 64  # stage keys a validator knows
MAX_SKEW = 60.0  # seconds a record's time may lie ahead of the reader's clock
MAX_TTL = 3600.0  # the longest life a record may claim (a replayed old record has expired)
# how much later than its signed expiry a record may be stored to expire in the DHT: publish() stores it
# with exactly that expiry, so this only absorbs float rounding through the DHT's serialization
EXPIRY_SLACK = 1.0


class TrustError(ValueError):
    """A record that must not be believed, with the reason."""


class Expired(TrustError):
    """A record past its expiry: an honest one at its end of life (dropped quietly), or a replay."""


class AmbiguousRunKey(ValueError):
    """A reader without a fingerprint found the run published under several run keys."""


def config_name(run_id: str) -> str:
    return f"{run_id}_config"


def stage_name(run_id: str, stage: int) -> str:
    """The key of a stage's servers' records (each signed by the run key too)."""
    return f"{run_id}_stage{stage}"


def clients_name(run_id: str, stage: int) -> str:
    """The key of the records of a stage's volunteers: apart from its servers' key, so that what
    every peer reads each announce period (the servers) does not grow with the volunteers."""
    return f"{run_id}_clients{stage}"


# the kinds of a run's keys, and the record kind each holds ("config": the run's config)
KEY_KINDS = {"config": None, "stage": "server", "clients": "client"}


def key_name(run_id: str, kind: str, stage: int | None) -> str:
    """The DHT key of `kind` ("config", "stage" or "clients") of stage `stage`."""
    if kind == "config":
        return config_name(run_id)
    return stage_name(run_id, stage) if kind == "stage" else clients_name(run_id, stage)


def fingerprint(public_der: bytes) -> str:
    return hashlib.sha256(public_der).hexdigest()[:FINGERPRINT_LEN]


def _public_der(key) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def peer_id_of(public_der: bytes) -> str:
    """The libp2p peer id (base58) of an RSA public key in DER, as libp2p derives it."""
    import multihash  # comes with hivemind (py-multihash)
    from hivemind.p2p import PeerID
    from hivemind.proto import crypto_pb2

    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=public_der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


class SigningKey:
    """An RSA private key that signs records: a run key, or a node's libp2p identity."""

    def __init__(self, private_key):
        self._key = private_key
        self.public_der = _public_der(private_key)
        self.fingerprint = fingerprint(self.public_der)

    def sign(self, payload: bytes) -> bytes:
        return self._key.sign(payload, padding.PKCS1v15(), hashes.SHA256())

    def derive(self, label: bytes) -> bytes:
        """A 32-byte secret bound to this private key and `label` (SHA-256 of both): what holders of
        the run key share without sending it (the lease tickets' key, core/protocol/leases.py)."""
        der = self._key.private_bytes(
            serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return hashlib.sha256(label + b"\0" + der).digest()

    @classmethod
    def generate(cls) -> "SigningKey":
        return cls(rsa.generate_private_key(public_exponent=65537, key_size=2048))

    def save(self, path: str) -> None:
        """Write the key as PEM, readable by its owner only, without replacing an existing file."""
        pem = self._key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)

    @classmethod
    def load(cls, path: str) -> "SigningKey":
        """A run key written by `save`; ValueError naming the file if it is not one."""
        try:
            with open(path, "rb") as f:
                key = serialization.load_pem_private_key(f.read(), password=None)
        except OSError as e:
            raise ValueError(f"run key {path}: {e.strerror or e}") from None
        except (ValueError, TypeError) as e:
            raise ValueError(f"run key {path}: not a PEM private key ({e})") from None
        if not isinstance(key, rsa.RSAPrivateKey):
            raise ValueError(f"run key {path}: not an RSA key")
        return cls(key)

    @classmethod
    def load_or_create(cls, path: str) -> tuple["SigningKey", bool]:
        """(the key at `path`, whether it was created now)."""
        if os.path.exists(path):
            return cls.load(path), False
        key = cls.generate()
        key.save(path)
        return key, True

    @classmethod
    def from_identity(cls, path: str) -> "SigningKey":
        """The private key of a libp2p identity file (hivemind's: protobuf around an RSA DER key)."""
        from hivemind.proto import crypto_pb2

        with open(path, "rb") as f:
            data = crypto_pb2.PrivateKey.FromString(f.read()).data
        return cls(serialization.load_der_private_key(data, password=None))


def _payload(name: str, subkey: str, body: dict, t: float, expires: float) -> bytes:
    return msgpack.packb([name, subkey, body, t, expires], use_bin_type=True)


def seal(
    name: str,
    subkey: str,
    body: dict,
    ttl: float,
    signer: SigningKey,
    run_key: SigningKey | None = None,
    now: float | None = None,
) -> dict:
    """The envelope of `body` under key `name` and `subkey`, signed by `signer` (and by the run key)."""
    t = float(now if now is not None else dht_now())
    expires = t + float(ttl)
    payload = _payload(name, subkey, body, t, expires)
    return {
        "body": body,
        "time": t,
        "expires": expires,
        "signer": signer.public_der,
        "sig": signer.sign(payload),
        "run_key": run_key.public_der if run_key is not None else None,
        "run_sig": run_key.sign(payload) if run_key is not None else None,
    }


def digest(*parts: bytes) -> bytes:
    """SHA-256 of `parts`, each length-prefixed (so that no two different tuples share the input):
    the key under which a verdict about those bytes is remembered. A record is kilobytes; holding
    the bytes themselves as keys made each full cache of 4,096 verdicts weigh megabytes per process,
    filling in the soak's first minutes and counted as growth. A forged triple would need a SHA-256
    collision with one that verified."""
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.digest()


class Remembered:
    """A bounded map of verdicts, the least recently used forgotten first: what the record validators
    remember per stored bytes, keyed by their `digest` (this module's signatures, schema.py's schema
    verdicts)."""

    def __init__(self, size: int = 4096):
        self.size = size
        self._items: collections.OrderedDict = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key, default=None):
        if key not in self._items:
            return default
        self._items.move_to_end(key)
        return self._items[key]

    def put(self, key, value) -> None:
        self._items[key] = value
        if len(self._items) > self.size:
            self._items.popitem(last=False)

    def pop(self, key, default=None):
        return self._items.pop(key, default)

    def clear(self) -> None:
        self._items.clear()


# signatures that verified, (public key, signature, signed bytes): every DHT node re-validates the same
# stored record each time a reader asks for it (a swarm reads each record a few times per announce
# period), and an RSA check with its key parse costs ~0.2 ms of a busy core. Only a triple that
# verified is kept, so a forgery can never be answered from here.
VERIFIED_CACHE = 4096
_VERIFIED = Remembered(VERIFIED_CACHE)


def _verify(public_der: Any, payload: bytes, signature: Any, whose: str) -> None:
    if not isinstance(public_der, bytes) or not isinstance(signature, bytes):
        raise TrustError(f"{whose} key or signature missing")
    triple = digest(public_der, signature, payload)
    if _VERIFIED.get(triple):
        return
    _verify_uncached(public_der, payload, signature, whose)
    _VERIFIED.put(triple, True)


def _verify_uncached(public_der: bytes, payload: bytes, signature: bytes, whose: str) -> None:
    try:
        key = serialization.load_der_public_key(public_der)
    except (ValueError, TypeError):
        raise TrustError(f"{whose} key is not a DER public key") from None
    if not isinstance(key, rsa.RSAPublicKey):
        raise TrustError(f"{whose} key is not an RSA key")
    try:
        key.verify(signature, payload, padding.PKCS1v15(), hashes.SHA256())
    except InvalidSignature:
        raise TrustError(f"bad {whose} signature") from None


def dht_now() -> float:
    from hivemind.utils import get_dht_time

    return get_dht_time()


ENVELOPE_FIELDS = ("body", "time", "expires", "signer", "sig", "run_key", "run_sig")


def open_record(
    run_id: str, kind: str, stage: int | None, subkey: Any, value: Any, run_fp: str | None, now: float | None = None
) -> dict:
    """The body of an envelope read under the run's `kind` key ("config", "stage": a stage's servers,
    "clients": its volunteers), after every check; TrustError with the reason otherwise. `run_fp`: the run key a reader trusts (None:
    any run key whose own signature holds, for a reader that has not learnt the run's yet)."""
    from core.protocol import records

    if not isinstance(value, dict) or set(value) != set(ENVELOPE_FIELDS):
        raise TrustError("not a signed record (expected the fields " + ", ".join(ENVELOPE_FIELDS) + ")")
    body, t, expires = value["body"], value["time"], value["expires"]
    if not isinstance(body, dict) or not isinstance(t, float) or not isinstance(expires, float):
        raise TrustError("signed record: 'body' must be a map and 'time', 'expires' floats")
    if not isinstance(subkey, str):
        raise TrustError(f"subkey must be a string, got {type(subkey).__name__}")
    now = dht_now() if now is None else now
    if t > now + MAX_SKEW:
        raise TrustError(f"timestamp {t - now:.0f} s in the future")
    if expires < now:
        raise Expired(f"expired {now - expires:.0f} s ago")
    if not 0 <= expires - t <= MAX_TTL:
        raise TrustError(f"claims a life of {expires - t:.0f} s (at most {MAX_TTL:.0f})")
    if kind not in KEY_KINDS:
        raise TrustError(f"unknown key kind {kind!r}")
    name = key_name(run_id, kind, stage)
    payload = _payload(name, subkey, body, t, expires)
    _verify(value["signer"], payload, value["sig"], "writer's")
    if kind == "config":
        if fingerprint(value["signer"]) != subkey:
            raise TrustError("a config record must be stored under its run key's fingerprint")
        if run_fp is not None and subkey != run_fp:
            raise TrustError(f"config of another run key ({subkey}, this run is {run_fp})")
        try:
            records.RunConfig.from_dict(body)
        except ValueError as e:
            raise TrustError(str(e)) from None
        return body
    if peer_id_of(value["signer"]) != subkey:
        raise TrustError(f"record for peer {subkey[-8:]} signed by another peer's key")
    try:
        rec = records.parse_record(body)
    except ValueError as e:
        raise TrustError(str(e)) from None
    if rec.stage != stage:
        raise TrustError(f"record of stage {rec.stage} under stage {stage}'s key")
    if rec.kind != KEY_KINDS[kind]:
        whose = "servers'" if kind == "stage" else "volunteers'"
        raise TrustError(f"a {rec.kind} record under stage {stage}'s {whose} key")
    if rec.kind == "server":
        _verify(value["run_key"], payload, value["run_sig"], "run")
        if run_fp is not None and fingerprint(value["run_key"]) != run_fp:
            raise TrustError(
                f"server record signed by another run key ({fingerprint(value['run_key'])}, this run is {run_fp})"
            )
    elif value["run_key"] is not None or value["run_sig"] is not None:
        raise TrustError("a volunteer's record must not carry a run signature")
    return body
