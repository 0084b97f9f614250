"""Composite checkpoints: atomic publication and verification (`store`); the state writers come next."""
