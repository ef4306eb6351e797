"""Tests mirroring the packages; multi-rank tests run on CPU with gloo."""
