"""The deployment family: the service stack as ``services`` rows (docs/deployment.md)."""
