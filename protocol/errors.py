"""The error type for anything malformed that arrives from the network, a file or a peer, and its typed cases."""


class ProtocolError(ValueError):
    """Raised when untrusted bytes or records are malformed, oversized, out of range or non-finite.

    The message says what was wrong and, where it helps, what the sender or operator can do.
    Every decoder in ``hlbp.protocol`` raises this type and no other for bad input.
    """


class RecordExpired(ProtocolError):
    """A well-signed record whose lifetime is over: the normal end of a record, not an attack, so readers drop it
    quietly instead of logging or reporting it as rejected."""
