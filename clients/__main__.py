"""`python -m clients models|health|infer|generate|perf`: the client commands without the server installed."""

from clients.cli import main

raise SystemExit(main())
