"""Typed errors of the transport. Every one derives from `TransportError`."""


class TransportError(Exception):
    """Base class of every error the transport raises."""


class FrameError(TransportError):
    """Bytes on a connection that are not a valid frame (bad magic, header checksum, lengths)."""


class UnsupportedVersion(FrameError):
    """A peer speaks a wire-format version this build does not."""


class CodecError(TransportError):
    """A payload that its codec cannot decode, or a codec/dtype combination it does not support."""


class TicketRejected(TransportError):
    """A transfer ticket that is forged, expired, replayed, or for another shipment."""


class TransferTimeout(TransportError):
    """A transfer missed its deadline."""


class PeerUnavailable(TransportError):
    """The peer cannot be reached, or every stream to it broke and reconnecting failed."""


class TransferCanceled(TransportError):
    """The transfer was canceled by either side."""
