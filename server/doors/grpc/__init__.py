"""gRPC front end: translate protobuf <-> request records; no batching logic lives here."""
