"""Error type for bad user input: flags, config files, data paths, checkpoints.

Network bytes raise ``hlbp.protocol.ProtocolError`` instead. The CLI turns both into a one-line message and
exit status 2, never a traceback.
"""


class UserInputError(ValueError):
    """A flag, file or path given by the user is unusable. The message says what to do about it."""


class RunFailed(RuntimeError):
    """A run that a command started and measures (a simulation's or a benchmark's peers) did not give what it
    measures: a peer exited or stalled before it was ready, or too few rounds or steps finished. The CLI prints
    the message (which names the peer and its last output) and exits with status 1, without a traceback: a
    failed run is an outcome to report, not a bug in the command."""
