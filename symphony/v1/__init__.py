"""gRPC stubs for `proto/symphony/v1/*.proto`, generated at install time (see symphony/protogen.py)."""
