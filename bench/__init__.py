"""Benchmarks: each prints a table, writes JSON + Markdown + PNG under bench/results/."""
