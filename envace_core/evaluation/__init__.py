"""Benchmark evaluation adapters (FinMCP-Bench, VitaBench, ...); import the submodules directly."""
