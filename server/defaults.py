"""Server-wide defaults, each written once: the CLI, ServerConfig and the registry all read them here."""

DEFAULT_MAX_BATCH_SIZE = 4  # max_batch_size given to configs completed from the model file
DRAIN_GRACE_S = 30.0  # how long shutdown, unload and reload wait for admitted work
MAX_QUEUED_REQUESTS = 10_000  # per model version, whatever its queue policy says
