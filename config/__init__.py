"""The hydra config tree of verl_dmd, shipped as package data (YAML only)."""
