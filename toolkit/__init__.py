"""Toolkit: everything a training job needs around the model.

The trainer, launcher, config schema, data, optimizers, checkpoints, metrics
and logging. It builds on ``sbp_core`` (global tensors, placements, boxing)
and ``runtime`` (the actor runtime) and is what recipes and ``train.py`` use;
it never defines a model. ``toolkit.rank_pool`` runs functions on a reusable
pool of local gloo ranks for tests and scripts.
"""
