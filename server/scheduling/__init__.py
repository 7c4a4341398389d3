"""Batching policies. Pure: they take `now_ns` as an argument and import no torch, grpc or asyncio."""
