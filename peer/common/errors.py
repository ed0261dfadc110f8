"""Error type for bad user input: flags, config files, data paths, checkpoints.

Network bytes raise ``hlbp.protocol.ProtocolError`` instead. The CLI turns both into a one-line message and
exit status 2, never a traceback.
"""


class UserInputError(ValueError):
    """A flag, file or path given by the user is unusable. The message says what to do about it."""
