"""Domain errors. Each class names the client-visible outcome; rpc/errors.py maps them to gRPC codes.

Code below the rpc layer raises these and never imports grpc, so schedulers and backends stay
testable without a server.
"""


class FerryError(Exception):
    """Base for errors whose message is meant for the client."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidInputError(FerryError):
    """The request cannot be run as sent (names, shapes, datatypes, parameters)."""


class ModelNotFoundError(FerryError):
    """No such model or version in the repository."""


class ModelUnavailableError(FerryError):
    """The model exists but cannot serve now (loading, failed, unloading, server draining)."""


class QueueFullError(FerryError):
    """Admission refused: the model's queue is at its limit."""


class DeadlineExceededError(FerryError):
    """The request's deadline passed before it could run."""


class BackendError(FerryError):
    """The backend failed while running a batch; only that batch's requests see it."""


class UnsupportedError(FerryError):
    """The call is valid but this model or server does not offer it."""


class ConfigError(FerryError):
    """A model configuration is invalid; the message names the file and the field."""


class RegionNotFoundError(FerryError):
    """No shared memory region (or shared memory object) by that name."""


class AlreadyExistsError(FerryError):
    """The name is taken (a shared memory region registered twice)."""


class DisabledError(FerryError):
    """The server's operator has not turned this on (a flag enables it); the message names the flag."""


class UnknownError(FerryError):
    """A Python model answered with pb_utils.TritonError.UNKNOWN: gRPC UNKNOWN, as Triton answers it."""


class RequestCancelledError(FerryError):
    """A request answered as cancelled (a Python model's TritonError.CANCELLED): gRPC CANCELLED."""


class ResourceExhaustedError(FerryError):
    """The server lacks the resource the request needs (a model that does not fit its memory budget)."""
