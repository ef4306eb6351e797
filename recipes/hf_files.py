"""The weight files of a Hugging Face model directory, read a region of a tensor at a time.

``trainer.init_from=<a Hugging Face directory>`` leaves a stage's parameters
on the meta device and gives the model an ``init_shard(name, box)`` that
reads them (``sbp_core``'s contract: ``distribute_module`` asks each rank for
the box of each parameter it keeps), so no rank reads the whole checkpoint.
Each recipe maps its names and layout onto the file's
(``recipes/gpt2/hf.py``, ``recipes/llama/hf.py``); this file reads, and
``tensor_problems`` runs a recipe's reader against the headers alone before
any process starts.

Not DCP's ``HuggingFaceStorageReader``: it loads into
a state dict of DTensors through DCP's planner, where ours are global
tensors built box by box, sometimes from a permutation of the file's columns
(GPT-2's ``c_attn``) or with padding rows (a padded vocabulary).
"""
from __future__ import annotations

import json
import os

import torch


def weight_files(path: str) -> tuple:
    """``(files, index file or None)`` of a Hugging Face directory's weights (safetensors first, then
    ``.bin``, each sharded by an index or whole); ``FileNotFoundError`` when there are none."""
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        ipath = os.path.join(path, index_name)
        if os.path.isfile(ipath):
            with open(ipath) as f:
                return sorted(set(json.load(f)["weight_map"].values())), ipath
        if os.path.isfile(os.path.join(path, single)):
            return [single], None
    raise FileNotFoundError(f"{path}: no model.safetensors, pytorch_model.bin or their .index.json")


class HFFiles:
    """The tensors of the Hugging Face directory ``path`` by name: ``names``, ``shape(name)`` and
    ``read(name, region, dtype)`` (``region``: a tuple of slices, one per leading dim).

    safetensors files are opened once and sliced (``get_slice``: only the region's bytes are read); a ``.bin``
    is memory-mapped (``torch.load(mmap=True)``), so only the pages that hold the region are read (for a split
    of columns, most of the tensor's). Files close when this object goes.
    """

    def __init__(self, path: str):
        self.path, self._open = path, {}
        files, index = weight_files(path)
        if index is not None:
            with open(index) as f:
                self.where = dict(json.load(f)["weight_map"])
        else:
            self.where = {name: files[0] for name in self._file(files[0]).keys()}
        self.names = set(self.where)

    def _file(self, file: str):
        """An open safetensors file, or a ``.bin``'s memory-mapped state dict (both have ``keys()``)."""
        if file not in self._open:
            fpath = os.path.join(self.path, file)
            try:
                self._open[file] = self._opened(fpath)
            except OSError:
                raise
            except Exception as err:  # a corrupt or truncated file: whatever its reader raised, named here
                raise ValueError(f"{fpath} cannot be read: {type(err).__name__}: {err}") from err
        return self._open[file]

    @staticmethod
    def _opened(fpath: str):
        if fpath.endswith(".safetensors"):
            from safetensors import safe_open

            return safe_open(fpath, framework="pt")
        try:  # weights only: a .bin cannot run code while it loads
            return torch.load(fpath, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # saved by torch < 1.6 (not a zip file): it cannot be mapped, so it is read whole
            return torch.load(fpath, map_location="cpu", weights_only=True)

    def _tensor(self, name: str):
        """The open file's handle of ``name`` (a safetensors slice, or a mapped tensor)."""
        opened = self._file(self.where[name])
        if hasattr(opened, "get_slice"):
            return opened.get_slice(name)
        if name not in opened:
            raise ValueError(f"{self.path}: the index puts {name} in {self.where[name]}, which lacks it")
        return opened[name]

    def shape(self, name: str) -> tuple:
        t = self._tensor(name)
        return tuple(t.get_shape() if hasattr(t, "get_shape") else t.shape)

    def read(self, name: str, region: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The ``region`` of tensor ``name`` in ``dtype``, a tensor of its own (not a view of a mapped file); an
        empty region (a rank's share of fewer rows than ranks) reads nothing."""
        if any(r.stop <= r.start for r in region):
            return torch.empty(tuple(max(0, r.stop - r.start) for r in region), dtype=dtype)
        t = self._tensor(name)
        if hasattr(t, "get_shape"):
            return t[region].to(dtype)  # safetensors copies the region out
        return t[region].to(dtype, copy=True)


def tensor_problems(reader, recipe, path: str, cfg) -> list:
    """What ``reader(path, model, cfg.model)`` (a ``ShardReader``, which checks every parameter's name and shape
    against the files' headers) refuses for a meta build of the model, without the ``trainer.init_from`` prefix."""
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = recipe.build_model(cfg.model)
    except (ValueError, TypeError, KeyError, RuntimeError, ZeroDivisionError):
        return []  # dimensions the model cannot take: recipe.check names them
    try:
        reader(path, model, cfg.model)
    except (ValueError, OSError) as err:  # HFFiles names a file it cannot read as a ValueError
        return [str(err).removeprefix(f"trainer.init_from={path}: ")]
    return []
