"""The model repository: config files and version folders on disk -> live, ready models."""
