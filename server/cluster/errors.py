"""Errors of the KV transfer layer, one tree (httpx style).

::

    TransferError
     ├── ProtocolError       a malformed frame or header: bad magic/version, oversize, invalid
     │   │                   JSON, wrong kinds or fields, a payload that does not fit the shape
     │   └── Unauthenticated a frame without a valid HMAC under the cluster's key (refused)
     ├── CorruptPayload      the payload's crc32 does not match its header (flipped bits)
     ├── TransferClosed      the peer went away mid-transfer (or refused the connection)
     ├── TransferRejected    the receiver answered "error": it refused or failed the transfer
     └── TransferTimeout     a connect, a write or an awaited reply took longer than allowed

Both ends raise the same classes; a receiver turns any of them into an ``error`` frame, which
the sender raises as :class:`TransferRejected` carrying the receiver's message.
"""

from __future__ import annotations


class TransferError(Exception):
    """Base of every error raised by ``server.cluster``."""


class ProtocolError(TransferError):
    """A frame or header does not follow the protocol; the message says which field and why."""


class Unauthenticated(ProtocolError):
    """A frame's HMAC tag is missing or wrong: the peer does not hold the cluster secret, or
    the frame was altered, reordered or replayed."""


class CorruptPayload(TransferError):
    """The payload's checksum does not match the one in its header."""


class TransferClosed(TransferError):
    """The connection ended (or never started) before the transfer completed."""


class TransferRejected(TransferError):
    """The receiver refused or failed the transfer; the message is the receiver's."""


class TransferTimeout(TransferError):
    """A step of the transfer took longer than its timeout."""
