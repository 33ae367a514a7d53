"""The one exception type of the client."""
import grpc


class DiondError(Exception):
    """A failed call to the daemon.

    Attributes:
      code:    grpc.StatusCode of the failure (UNAVAILABLE when the daemon cannot be reached or
               died, DEADLINE_EXCEEDED when a call ran past its deadline, INVALID_ARGUMENT /
               FAILED_PRECONDITION / NOT_FOUND for requests the daemon refused, ...).
      message: the daemon's message (it names the field and the value), or the client's own.
      method:  the RPC ("Step", "CreateSession", ...), or None.
    """

    def __init__(self, code, message, method=None):
        self.code = code
        self.message = message
        self.method = method
        where = f"{method}: " if method else ""
        super().__init__(f"{where}{code.name}: {message}")

    @classmethod
    def from_rpc_error(cls, err, method, target=None):
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        message = err.details() if hasattr(err, "details") else str(err)
        if code is None:
            code = grpc.StatusCode.UNKNOWN
        if code == grpc.StatusCode.UNAVAILABLE and target:
            message = f"{message} (daemon at {target} unreachable or gone)"
        return cls(code, message or "", method)
