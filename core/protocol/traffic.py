"""Bytes a server received ("<method>.request") and answered ("<method>.response"). Every message
of a run goes to a server or comes back from one, so the servers' counters add up to the run's
traffic. One process-wide counter; the servicer adds to it, `status` reports it. VALUES counts the
tensor elements each method's requests carried, whatever their wire dtype: bytes per value is what
`--compress` buys (4 for float32 on the wire, about 1 for 8-bit), however many times work was re-sent. CALLS counts the calls of each method that reached a server over
the network (a server's own worker calls its server in-process, which costs no RPC); SESSION_CALLS those
of them that came over a session (core/protocol/session.py), the others as a stream call of their own."""

from __future__ import annotations

import collections

TRAFFIC: collections.Counter = collections.Counter()
VALUES: collections.Counter = collections.Counter()
CALLS: collections.Counter = collections.Counter()
SESSION_CALLS: collections.Counter = collections.Counter()
