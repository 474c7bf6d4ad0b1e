"""Triton plumbing shared by the model.py files (they import this with the repo root on PYTHONPATH)."""
