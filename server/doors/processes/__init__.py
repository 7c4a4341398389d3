"""Front-end processes (`--frontend-processes N`): gRPC decoding and encoding spread over several processes on
one port, handing ModelInfer tensors to the engine process through shared memory (see docs/architecture.md)."""
