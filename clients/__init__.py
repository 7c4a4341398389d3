"""Ferry clients: a Python client library and the ferry command line (see issue 6)."""
