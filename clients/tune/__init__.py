"""`ferry tune`: search a model's batching configuration by hot reload and measurement (docs/tuning.md)."""
