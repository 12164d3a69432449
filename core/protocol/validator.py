"""The run's record validator inside every DHT node (hivemind's record-validator hook): it applies
the rules of core/protocol/trust.py to every record stored or answered under the run's keys, drops
and counts what breaks them, and keeps the valid entries of a key when one entry fails."""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import RecordValidatorBase

from core.protocol import trust
from core.protocol.trust import (
    EXPIRY_SLACK,
    MAX_STAGES,
    Expired,
    Remembered,
    TrustError,
    config_name,
    digest,
    key_name,
)

logger = logging.getLogger("hivepipe.trust")


@dataclass
class Rejection:
    time: float
    key: str
    subkey: str
    reason: str


class RunValidator(RecordValidatorBase):
    """hivemind record validator of one run's keys; keys of other runs pass
    through untouched. Every record it drops is counted and kept (the last 100) with the reason."""

    def __init__(self, run_id: str, run_fp: str | None):
        self.run_id, self.run_fp = run_id, run_fp
        self.keys: dict[bytes, tuple[str, int | None]] = {
            DHTID.generate(source=config_name(run_id)).to_bytes(): ("config", None)
        }
        for kind in ("stage", "clients"):
            for k in range(MAX_STAGES):
                self.keys[DHTID.generate(source=key_name(run_id, kind, k)).to_bytes()] = (kind, k)
        self.rejected: collections.deque[Rejection] = collections.deque(maxlen=100)
        self.rejected_total = 0
        self._passed = Remembered()  # digest of a record that passed -> its envelope's expiry

    @property
    def priority(self) -> int:
        return 20  # checked before the schema validator (hivemind checks in decreasing priority)

    def check(self, record) -> str | None:
        """Why `record` (a hivemind DHTRecord) must be dropped, or None. A record that passed is
        remembered (by its bytes and its expiration time) until its envelope expires: a DHT node
        checks the same stored record again on every read that reaches it, and the checks beside
        the signatures (decoding, the record's fields, the signer's peer id) were a quarter of an
        idle swarm's DHT processes' time."""
        where = self.keys.get(record.key)
        if where is None:
            return None
        remembered = digest(record.key, record.subkey, record.value, repr(record.expiration_time).encode())
        until = self._passed.get(remembered)
        if until is not None and trust.dht_now() <= until:
            return None
        reason, expires = self._check(record, *where)
        if reason is None and expires is not None:
            self._passed.put(remembered, expires)
        return reason

    def _check(self, record, kind: str, stage: int | None) -> tuple[str | None, float | None]:
        """(why `record` must be dropped or None, and, when it passed every check, its envelope's expiry)."""
        if record.subkey in DHTProtocol.RESERVED_SUBKEYS:
            return "the run's records are stored under subkeys", None
        try:
            subkey = DHTProtocol.serializer.loads(record.subkey)
            value = DHTProtocol.serializer.loads(record.value)
        except Exception as e:
            return f"undecodable: {type(e).__name__}", None
        try:
            trust.open_record(self.run_id, kind, stage, subkey, value, self.run_fp)
        except Expired as e:
            # one stored to live on past its envelope is a replay. An honest record at its end of
            # life (stored with the envelope's expiry) passes: the DHT drops it at that expiry and
            # readers skip it (record_store.open_stage), while refusing it here made hivemind drop the
            # whole stage key a DHT node answered with (it refuses a map when one entry fails), a
            # record that expired between that node's answer and this check hiding every other
            if (
                isinstance(value, dict)
                and isinstance(value.get("expires"), float)
                and record.expiration_time > value["expires"] + EXPIRY_SLACK
            ):
                return f"replayed: {e}", None
            return None, None
        except TrustError as e:
            return str(e), None
        if record.expiration_time > value["expires"] + EXPIRY_SLACK:
            # a genuine record stored to live on past its signature: a node keeps, per subkey, the entry
            # that expires last, so it would shadow the signer's fresh records, and once its signature
            # ran out, hide the whole key from readers (a discovery blackout for as long as the replayer chose)
            return (
                f"outlives its signature: stored to expire {record.expiration_time - value['expires']:.0f} s "
                "after its signed expiry"
            ), None
        return None, value["expires"]

    def validate(self, record) -> bool:
        reason = self.check(record)
        if reason is None:
            return True
        key = key_name(self.run_id, *self.keys[record.key])
        try:
            subkey = str(DHTProtocol.serializer.loads(record.subkey))
        except Exception:
            subkey = "?"
        self.rejected_total += 1
        self.rejected.append(Rejection(time.time(), key, subkey, reason))
        logger.info("dropped a record under %s (subkey %s): %s", key, subkey[-12:], reason)
        return False


def _validate_each_entry(self, key_bytes: bytes, dictionary) -> bool:
    """DHTProtocol._validate_dictionary as the run needs it: an entry that fails the validators is
    dropped from the map and the others are kept. hivemind's own refuses the whole map when one entry
    fails, so a single unusable record (one that just expired, or junk a rogue node answers with)
    would hide every server of a stage from the reader. False only when no entry is left of a
    map that had some."""
    if self.record_validator is None:
        return True
    from hivemind.dht.validation import DHTRecord

    bad = []
    with dictionary.freeze():
        for subkey, (value_bytes, expiration_time) in dictionary.items():
            record = DHTRecord(key_bytes, self.serializer.dumps(subkey), value_bytes, expiration_time)
            if not self.record_validator.validate(record):
                bad.append(subkey)
    for subkey in bad:
        del dictionary[subkey]
    return not bad or len(dictionary) > 0


def keep_valid_entries() -> None:
    """Make this process's DHT protocol (and its forks': a hivemind DHT runs in a forked process)
    keep the valid entries of a map when some entry fails (`_validate_each_entry`)."""
    DHTProtocol._validate_dictionary = _validate_each_entry


def validators(run_id: str, run_fp: str | None) -> list:
    """What every DHT node of the run is given: the envelope schema and the signature rules (and the
    rule that one bad entry under a key does not hide the others: `keep_valid_entries`)."""
    from core.protocol.schema import run_schema_validator

    keep_valid_entries()
    return [RunValidator(run_id, run_fp), run_schema_validator(run_id)]
