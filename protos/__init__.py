"""Ferry protocol definitions and generated gRPC/protobuf code (see generate.py)."""
