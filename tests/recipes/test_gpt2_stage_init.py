"""GPT-2 allocates only a rank's shards of its pipeline stage (``GPT2Recipe.build_stage``), with the whole
model's values.

Each parameter is initialised from the seed and its name alone, so a stage
built on the meta device and cut, its parameters then built box by box
(``GPT2LMHeadModel.init_shard``, as ``distribute_module`` asks for each
rank's shard), holds bit for bit what ``build_model`` (the whole model,
built as one device builds it) holds under the same names, the tied LM head
and the buffers included; building the stage allocates its buffers alone,
and building a shard about the shard (and one whole parameter while it is drawn).
"""
from functools import partial

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode

from recipes.gpt2.recipe import RECIPE
from toolkit.plain_loop import materialized
from toolkit.stages import keep_stages, stage_ranges

MODEL = dict(name="t", vocab_size=1001, n_positions=32, n_embd=32, n_layer=6, n_head=4, dropout=0.1,
             layer_norm_epsilon=1e-5, initializer_range=0.02, make_vocab_size_divisible_by=8)


def _stage(cfg, pp, stages):
    cut = partial(keep_stages, plan=RECIPE.pipeline_plan(cfg), ranges=stage_ranges(cfg.n_layer, pp), stages=stages)
    torch.manual_seed(7)
    return RECIPE.build_stage(cfg, cut)


@pytest.mark.parametrize("pp, stages", [(1, [0]), (2, [0]), (2, [1]), (3, [1]), (3, [0, 2])])
def test_a_stage_holds_the_whole_models_values(pp, stages):
    cfg = OmegaConf.create(MODEL)
    torch.manual_seed(7)
    whole = RECIPE.build_model(cfg)
    want = {**dict(whole.named_parameters(remove_duplicate=False)), **dict(whole.named_buffers())}
    stage = _stage(cfg, pp, stages)
    assert all(p.is_meta for p in stage.parameters()) and not any(b.is_meta for b in stage.buffers())
    stage = materialized(stage)  # each parameter's one box: the whole of it
    got = {**dict(stage.named_parameters(remove_duplicate=False)), **dict(stage.named_buffers())}
    ranges = stage_ranges(6, pp)
    layers = {f"transformer.h.{i}." for s in stages for i in ranges[s]}
    first, last = 0 in stages, pp - 1 in stages
    expect = {n for n in want if any(n.startswith(p) for p in layers)
              or (first and n.startswith(("transformer.wte", "transformer.wpe")))
              or (last and n.startswith(("transformer.ln_f", "lm_head")))
              or n == "vocab_padding"}
    assert set(got) == expect
    for name, t in got.items():
        assert t.device.type == "cpu" and torch.equal(t, want[name]), name
    if first and last:
        assert stage.lm_head.weight is stage.transformer.wte.weight
    # Another seed gives other values: the seed, not only the name, keys each draw.
    torch.manual_seed(8)
    other = RECIPE.build_model(cfg)
    assert not torch.equal(other.transformer.wpe.weight, whole.transformer.wpe.weight)


@pytest.mark.parametrize("name", ["transformer.wte.weight", "lm_head.weight", "transformer.h.1.attn.c_attn.weight",
                                  "transformer.h.1.mlp.c_proj.weight", "transformer.h.1.mlp.c_fc.bias",
                                  "transformer.h.1.ln_2.weight"])
def test_a_shard_is_the_whole_models_box(name):
    """Row and column halves and quarters (tensor parallel's ``S(0)``/``S(1)`` boxes) of the whole model's
    value; the tied LM head's are the embedding's."""
    cfg = OmegaConf.create(MODEL)
    torch.manual_seed(7)
    value = RECIPE.build_model(cfg).get_parameter(name).detach()
    stage = _stage(cfg, 1, [0])
    for dim in range(value.dim()):
        for parts in (2, 4):
            step = value.shape[dim] // parts
            for i in range(parts):
                box = tuple((i * step, step) if d == dim else (0, n) for d, n in enumerate(value.shape))
                want = value.narrow(dim, i * step, step)
                assert torch.equal(stage.init_shard(name, box), want), (name, box)


class _NewStorageBytes(TorchDispatchMode):
    """Bytes of every new CPU storage an op returns while active."""

    def __init__(self):
        super().__init__()
        self.seen, self.bytes = set(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.seen:
                    self.seen.add(ptr)
                    self.bytes += t.untyped_storage().nbytes()
        return out


def test_a_stage_allocates_its_buffers_alone_and_a_shard_about_itself():
    """The middle stage of pp3 (2 of 6 blocks, no embeddings): building it allocates its buffers only (a
    build of the whole model would allocate the 1008 x 256 embedding and all six blocks); a quarter of a
    column split allocates the quarter it keeps and the whole parameter it is cut from, freed after."""
    cfg = OmegaConf.create({**MODEL, "n_embd": 256, "n_head": 4})
    with _NewStorageBytes() as counted:
        stage = _stage(cfg, 3, [1])
    buffers = sum(b.numel() * b.element_size() for b in stage.buffers())
    assert buffers <= counted.bytes <= buffers + 2**16  # and the temporaries of their values; a block is 3 MB
    whole = stage.get_parameter("transformer.h.2.mlp.c_fc.weight")  # [256, 1024], on meta
    nbytes = whole.numel() * whole.element_size()
    with _NewStorageBytes() as counted:
        shard = stage.init_shard("transformer.h.2.mlp.c_fc.weight", ((0, 256), (256, 256)))
    assert shard.shape == (256, 256) and shard.untyped_storage().nbytes() == nbytes // 4
    assert counted.bytes <= nbytes + nbytes // 4 + 2**12


def test_init_from_a_hugging_face_directory_into_a_stage(tmp_path):
    """``GPT2Recipe.init_weights`` loads a HF directory into a stage: its parameters get HF's values (the
    last stage's LM head: HF's embedding, zero rows below the padding)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=1001, n_positions=32, n_embd=32, n_layer=6, n_head=4))
    hf.save_pretrained(tmp_path)
    cfg = OmegaConf.create(MODEL)
    last = _stage(cfg, 2, [1])
    assert RECIPE.init_weights(last, str(tmp_path), OmegaConf.create({"model": MODEL}))
    materialized(last)
    wte = hf.transformer.wte.weight
    assert torch.equal(last.lm_head.weight[:1001], wte) and not last.lm_head.weight[1001:].any()
    assert torch.equal(last.transformer.h[5].mlp.c_fc.weight, hf.transformer.h[5].mlp.c_fc.weight)
    assert torch.equal(last.transformer.ln_f.weight, hf.transformer.ln_f.weight)


def test_a_ranks_boxes_of_a_hugging_face_gpt2_are_those_of_the_converted_whole(tmp_path):
    """``ShardReader.read``: each tensor-parallel rank's box (``c_attn``'s columns of whole heads, in our per-head
    order; a padded vocabulary's rows, past HF's zero; the LM head's rows, the embedding's) equals that box of
    the whole state ``from_hf`` converts."""
    transformers = pytest.importorskip("transformers")
    from recipes.gpt2.hf import ShardReader, from_hf, read_hf_dir

    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=1001, n_positions=32, n_embd=32, n_layer=2,
                                                         n_head=4)).save_pretrained(tmp_path)
    cfg = OmegaConf.create({**MODEL, "n_layer": 2})
    with torch.device("meta"):
        model = RECIPE.build_model(cfg)
    reader = ShardReader(str(tmp_path), model, cfg)
    whole = from_hf(read_hf_dir(str(tmp_path))[1], {**{k: int(cfg[k]) for k in ("n_embd", "n_head", "n_layer",
                                                                                 "vocab_size", "n_positions")},
                                                     "make_vocab_size_divisible_by": int(cfg.make_vocab_size_divisible_by)})
    rows = model.transformer.wte.weight.shape[0]
    assert rows > 1001  # padded
    for tp in (2, 4):
        for r in range(tp):
            cols = 96 // tp
            box = ((0, 32), (r * cols, cols))
            got = reader.read("transformer.h.1.attn.c_attn.weight", box)
            assert torch.equal(got, whole["transformer.h.1.attn.c_attn.weight"][:, r * cols:(r + 1) * cols])
            got = reader.read("transformer.h.0.attn.c_attn.bias", ((r * cols, cols),))
            assert torch.equal(got, whole["transformer.h.0.attn.c_attn.bias"][r * cols:(r + 1) * cols])
            n = rows // tp
            for name in ("transformer.wte.weight", "lm_head.weight"):
                got = reader.read(name, ((r * n, n), (0, 32)))
                assert torch.equal(got, whole[name][r * n:(r + 1) * n]), (name, tp, r)
    # A share wholly past HF's 1001 rows (padding: zero, nothing read) and an empty one (more ranks than rows).
    assert torch.equal(reader.read("lm_head.weight", ((1002, 6), (0, 32))), torch.zeros(6, 32))
    assert reader.read("transformer.h.0.attn.c_attn.bias", ((96, 0),)).shape == (0,)
    # The file's shapes are checked against the model's before anything is read; options ours lacks are refused.
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    key = next(k for k in tensors if k.endswith("h.1.mlp.c_fc.weight"))
    save_file({**tensors, key: torch.zeros(32, 100)}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"other shapes than the model's: transformer.h.1.mlp.c_fc.weight is "
                                         r"\[32, 100\] there, \[32, 128\] here"):
        ShardReader(str(tmp_path), model, cfg)
    import json

    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        ShardReader(str(tmp_path), model, cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_box_drawn_a_block_of_rows_at_a_time_is_the_whole_draws(dtype, monkeypatch):
    """``normal_box`` with blocks of a few hundred values (so every shape below is drawn in many blocks, the last
    one under 16 values merged into the one before): each box equals that box of the whole tensor drawn at once
    from the same generator. It rests on how this torch's ``normal_`` consumes its stream, hence this test."""
    import recipes.gpt2.model as gpt2_model

    monkeypatch.setattr(gpt2_model, "BLOCK_VALUES", 300)
    for shape in [(1001, 32), (1000, 1), (333, 7), (97, 3, 5)]:
        full = tuple((0, n) for n in shape)
        rows = shape[0]
        for box in [full, ((rows // 3, rows // 3), *full[1:]), ((rows - 5, 5), *full[1:]),
                    ((0, rows), (1, shape[1] - 1), *full[2:])]:
            want = torch.empty(shape, dtype=dtype).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(3))
            got = gpt2_model.normal_box(shape, box, 0.02, torch.Generator().manual_seed(3), dtype)
            assert torch.equal(got, want[tuple(slice(s, s + n) for s, n in box)]), (shape, box)
