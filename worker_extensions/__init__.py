"""Code that runs inside inference-engine worker processes (one module per engine)."""
