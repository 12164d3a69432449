"""Bytes a server received ("<method>.request") and answered ("<method>.response"). Every message
of a run goes to a server or comes back from one, so the servers' counters add up to the run's
traffic. One process-wide counter; the servicer adds to it, `status` reports it."""
from __future__ import annotations

import collections

TRAFFIC: collections.Counter = collections.Counter()
