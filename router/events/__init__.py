"""KV events -> index: each replica's BlockStored / BlockRemoved stream kept in the index.

A replica's stream is followed by three pieces, the first two pure (no sockets, no
index: tested by feeding them batches):

- sequence.py  `SequenceTracker`: the stream's order. Fed (seq, payload), it returns
               a plan: clear the replica, apply batches, or first fetch a replay
               (gaps, duplicates, restarts, reconnects, first contact, and the
               catch-up when a subscription starts).
- planning.py  `BatchPlanner`: what one batch means for the index (`IndexOp`s), with
               LoRA scopes, rekeying for replicas keyed unlike the gateway, and
               hash-handshake probes kept apart for router/handshake.py.
- stream.py    `ReplicaEventStream`: the ZMQ transport (SUB + replay DEALER + socket
               monitor) that feeds the tracker and performs its plans on the index.

subscriptions.py runs one stream per replica as discovery adds and removes them
(`EventIndexer`, fed `ReplicaFeed`s); stats.py holds the counters all of them keep;
leadership.py runs the indexing only while this indexer holds the lease (active/standby).
"""

from router.events.leadership import lead_while_holding
from router.events.planning import DEFAULT_MEDIA, BatchPlanner, RekeyMode
from router.events.sequence import SequenceTracker
from router.events.stats import StreamStats
from router.events.stream import (
    DEFAULT_PROBE_TTL_S,
    DEFAULT_REPLAY_TIMEOUT_S,
    ReplayUnavailable,
    ReplicaEventStream,
)
from router.events.subscriptions import EventIndexer, ReplicaFeed, wait_caught_up

__all__ = [
    "DEFAULT_MEDIA",
    "DEFAULT_PROBE_TTL_S",
    "DEFAULT_REPLAY_TIMEOUT_S",
    "BatchPlanner",
    "EventIndexer",
    "RekeyMode",
    "ReplayUnavailable",
    "ReplicaEventStream",
    "ReplicaFeed",
    "SequenceTracker",
    "StreamStats",
    "lead_while_holding",
    "wait_caught_up",
]
