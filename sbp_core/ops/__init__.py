"""SBP signature rules for aten ops, one file per family; importing registers them."""
from . import creation, matmul, pointwise, reductions  # noqa: F401
