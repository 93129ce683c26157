"""Benchmark peers: standalone scripts run in another framework's interpreter (no mgpu import)."""
