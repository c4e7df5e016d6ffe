"""The front doors (gRPC, the Open Inference Protocol, tracing) against the JSON routes."""
