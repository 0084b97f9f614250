"""Composite checkpoints: atomic publication and verification (`store`), the engine state through DCP
(`engine_state`), the whole run's state (`composite`) and export of a role for inference (`export`)."""
