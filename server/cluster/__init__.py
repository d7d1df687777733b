"""KV transfer between processes and hosts, for disaggregated prefill and decode.

::

    prefill: encode(KVChunk) ─▶ Frame ─▶ KVSender ═ tcp:// inline payload ══▶ KVReceiver
                                                  ═ shm:// /dev/shm files ══▶   └▶ handler.on_frame
                                                                                    └▶ decode()

    codec.py      Codec (fp32, bf16, int8 per block), KVChunk, Frame, encode/decode, is_lossy
    wire.py       frame layout on a byte stream (MAGIC, VERSION), LinkStats
    tcp.py        TCPSender: one transfer over one TCP connection
    shm.py        ShmSender: control over TCP, payloads through shared-memory files
    transport.py  open_sender, KVReceiver, the ReceiveHandler and KVSender protocols
    errors.py     the transfer error tree
"""
