"""The front doors: gRPC (TEI, OIP), OIP REST and tracing, and how each carries a request's
priority and timeout."""
