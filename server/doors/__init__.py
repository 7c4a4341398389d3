"""The ways in: gRPC, HTTP, the front-end processes, and what they share (finding a runner, access, model control, drain)."""
