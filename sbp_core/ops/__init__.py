"""SBP signature rules for aten ops, one file per family; importing registers them."""
from . import attention, conv, creation, loss, matmul, nn, pointwise, reductions  # noqa: F401
from . import indexing, joining, slicing, views  # noqa: F401  (shape, view and indexing rules)
from . import sparse  # noqa: F401  (sparse COO gradients of embedding tables)
