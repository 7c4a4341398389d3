"""Ferry: a gRPC inference server built around batching."""

__version__ = "0.1.0"
