"""Test helpers that build small real models and pipelines offline (no downloads)."""
