"""The HTTP front door: KServe v2 REST (with Triton's binary tensor extension), Triton's generate
extension and an OpenAI-compatible API, translated to the same runners as gRPC (not named `http`,
so it never shadows the standard library)."""
