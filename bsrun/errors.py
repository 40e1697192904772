"""The one error type bsrun shows users: a sentence and an exit code, never a traceback."""


class BsrunError(Exception):
    """A failure explained in one sentence; `exit_code` is what bsrun exits with.

    2 means bad input (as click uses it); launch failures carry the failed rank's code.
    """

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code
