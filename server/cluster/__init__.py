"""Disaggregated serving: prefill and decode workers in separate processes, a router in front,
KV moved between them (docs/cluster.md).

::

    router (a server.backend.Backend)              prefill worker           decode worker
    place(request, snapshot) ── /internal/kv/expect ──────────────────────▶ Inbound: blocks COMPUTING
                             ── /internal/prefill ──▶ Outbound: add_context,
                                                      ship committed blocks ═▶ KVReceiver ─▶ write, commit
                             ── /internal/generate ───────────────────────▶ the request waits on them
           ◀── NDJSON TokenEvents ─────────────────────────────────────────────────────┘

    router.py     ClusterBackend: routing with server.policy, transfers, retries; RouterConfig
    members.py    Member (a worker as the router sees it), facts_of, check_worker
    stream.py     ClusterStream: a request's events, replaced before its first token if its worker dies
    metrics.py    RouterStats (what the router counts) and its Prometheus collector
    worker.py     Worker: a worker process's internal API (prefill or decode role), injected faults
    handoff.py    Outbound / Inbound: export and import KV blocks on the engine thread
    launch.py     LocalCluster, plan_workers, and the worker / router / serve --disaggregated entry points
    messages.py   the internal API's bodies (pydantic); engine errors across the wire
    codec.py      KVChunk, Frame, encode/decode, is_lossy: a frame of any registered codec; Codec
    codecs/       the codecs by name (register, get, names): fp32, bf16, int8 per block
    wire.py       frame layout on a byte stream (MAGIC, VERSION), LinkStats
    tcp.py        TCPSender: one transfer over one TCP connection
    shm.py        ShmSender: control over TCP, payloads through shared-memory files
    transport.py  open_sender, KVReceiver, the ReceiveHandler and KVSender protocols
    errors.py     the transfer error tree
    auth.py       ClusterSecret (internal calls' token, KV frames' HMAC key), the router's admin key
"""
