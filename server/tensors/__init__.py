"""Tensors from wire to batch and back: datatypes, raw bytes <-> numpy (`wire`), signatures, reshape,
classification, padding, batch assembly, shared-memory regions."""
