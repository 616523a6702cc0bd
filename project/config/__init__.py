"""From the composed Hydra config to a checked job: type and cross-key checks, resolvers, the error type."""
