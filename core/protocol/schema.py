"""The shape of a run's DHT values, as a pydantic schema for hivemind's SchemaValidator: every key
of the run (`{run}_config`, `{run}_stage0` ..., `{run}_clients0` ...) maps subkeys to a signed envelope (see trust.py).
The envelope's signatures and the record inside it are checked by validator.RunValidator (core/protocol/validator.py)."""

from __future__ import annotations

from typing import Any, Dict, Optional

import pydantic.v1 as pydantic
from hivemind.dht.schema import SchemaValidator

from core.protocol.trust import MAX_STAGES, Remembered, digest


class Envelope(pydantic.BaseModel):
    body: Dict[pydantic.StrictStr, Any]
    time: pydantic.StrictFloat
    expires: pydantic.StrictFloat
    signer: pydantic.StrictBytes
    sig: pydantic.StrictBytes
    run_key: Optional[pydantic.StrictBytes]
    run_sig: Optional[pydantic.StrictBytes]

    class Config:
        extra = pydantic.Extra.forbid


Records = Dict[pydantic.StrictStr, Envelope]

# one field per key of a run: the SchemaValidator's prefix (the run id) makes them `{run}_{field}`
RunKeys = pydantic.create_model(
    "RunKeys",
    config=(Optional[Records], None),
    **{f"{kind}{k}": (Optional[Records], None) for kind in ("stage", "clients") for k in range(MAX_STAGES)},
)


class CachedSchemaValidator(SchemaValidator):
    """hivemind's SchemaValidator with its verdicts remembered per stored bytes (key, subkey, value):
    the verdict is a pure function of them, and a DHT node validates the same stored record again on
    every read that reaches it (pydantic's parse and dict() were the largest share of a swarm's DHT
    processes' time). Bounded: the oldest verdicts go first."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._verdicts = Remembered()

    def merge_with(self, other) -> bool:
        merged = super().merge_with(other)
        if merged:
            self._verdicts.clear()  # another schema may accept what this one refused
        return merged

    def validate(self, record) -> bool:
        key = digest(record.key, record.subkey, record.value)
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = super().validate(record)
            self._verdicts.put(key, verdict)
        return verdict


def run_schema_validator(run_id: str) -> SchemaValidator:
    return CachedSchemaValidator(RunKeys, allow_extra_keys=True, prefix=run_id)
