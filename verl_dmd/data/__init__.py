"""Data sources: the embedded digits set (more providers arrive with the trainer)."""
