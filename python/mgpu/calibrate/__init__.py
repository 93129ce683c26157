"""Measurements: topo's tables of this machine (the calibration profile) and bench's
measuring harness (with its PyTorch peer under peers/). Imports selector/, train/ and the bottom."""
