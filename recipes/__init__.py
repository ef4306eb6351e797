"""Recipes: plain torch models plus a parallel plan.

Each recipe (gpt2, zero, insightface, wide_deep) pairs an ordinary
``torch.nn`` model with data: parameter-name patterns mapped to N-d SBP and
layers mapped to pipeline stages. Recipes import ``toolkit`` and ``sbp_core``
and never call a collective by hand; a model file never imports
the distributed package.
"""
