"""The PD stack the end-to-end tests start: it lives in benchmarks/stack.py, which the serving
benchmarks share."""

from benchmarks.stack import ROOT, PDStack, alive, descendants, pick_ports, rank_pids

__all__ = ["ROOT", "PDStack", "alive", "descendants", "pick_ports", "rank_pids"]
