"""Runnable verl_dmd recipes, shipped as package data (YAML only)."""
