"""Server-wide defaults, each written once: the CLI, ServerConfig and the registry all read them here."""

import os

DEFAULT_MAX_BATCH_SIZE = 4  # max_batch_size given to configs completed from the model file
DRAIN_GRACE_S = 30.0  # how long shutdown, unload and reload wait for admitted work
MAX_QUEUED_REQUESTS = 10_000  # per model version, whatever its queue policy says
HTTP_MAX_INPUT_SIZE = 1 << 26  # Triton's --http-max-input-size default: an HTTP body, and what its JSON tensors expand to
DEFAULT_SEQUENCE_IDLE_US = 1_000_000  # Triton's max_sequence_idle_microseconds when a config leaves it unset or 0


def max_queued_bytes() -> int:
    """Server-wide bound on queued request data: a quarter of the machine's memory (0 if unknown: no bound).

    Requests in the queues hold their decoded inputs; a quarter leaves room for the models, their
    outputs and the gRPC buffers of requests not yet admitted."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):  # a platform without these names
        return 0


def max_model_queued_bytes(server_limit: int) -> int:
    """Per model version: half the server's bound, so one flooded model leaves room for the others."""
    return server_limit // 2
