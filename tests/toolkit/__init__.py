"""Tests for toolkit/."""
