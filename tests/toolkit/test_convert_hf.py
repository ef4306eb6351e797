"""GPT-2 import from and export to Hugging Face ``transformers``: logits agree within 1e-5.

A randomly initialised ``transformers.GPT2LMHeadModel`` (every weight,
bias and LayerNorm perturbed, so the ``c_attn`` permutation of weights *and*
biases is exercised) is saved with ``save_pretrained`` (safetensors) and
imported with ``scripts/convert_hf.py``. Our model loads it under ``single``
and under ``tp2`` (Megatron's plan) and gives transformers' logits on the
same tokens. Under tp2 it then takes an AdamW step, saves a sharded
checkpoint, and the export of that checkpoint, loaded with
``GPT2LMHeadModel.from_pretrained``, gives our new logits; the export also
holds the run directory's ``tokenizer.json``, which ``transformers`` loads
and which encodes as the run's tokenizer does.
"""
import json
import os

import pytest
import torch
import torch.distributed as dist

import sbp_core as sc
from recipes.gpt2.model import GPT2Config, GPT2LMHeadModel
from sbp_core.sbp import Broadcast
from scripts import convert_hf
from benchkit.parity import GPT_TP, GPT_TP_PINS
from toolkit import checkpoint as ckpt
from recipes.gpt2 import hf as hf_gpt2
from recipes.gpt2.data.tokenizer import tokenizer_of_weights
from toolkit.rank_pool import get_pool

WORLD = 2  # tp2 needs two ranks; "single" leaves rank 1 outside the placement


def _transformers():
    """Imported here, not at module level: the ranks import this module and never need it."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers
TOL = 1e-5
TIED = [hf_gpt2.TIED]


def _hf_model(vocab_size=256):
    transformers = _transformers()
    cfg = transformers.GPT2Config(vocab_size=vocab_size, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                  embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                                  eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _tokens(vocab_size=256):
    return torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))


def _run_tokenizer(run_dir):
    """A ``tokenizer.json`` in ``run_dir`` as a GPT-2 run keeps it (``train_bpe``'s byte-level BPE); returns it."""
    from recipes.gpt2.data.tokenizer import train_bpe

    os.makedirs(run_dir, exist_ok=True)
    tok = train_bpe(["def f(x):\n    return x + 1\n", "class A:\n    pass\n"] * 10, 300)
    tok.save(os.path.join(run_dir, "tokenizer.json"))
    return tok


def our_logits(ckpt_dir, layout, tokens, export_root=None):
    """Worker: our GPT-2 from the checkpoint under ``layout``; rank 0 returns its logits
    (and, with ``export_root``, the logits after one AdamW step saved there)."""
    extra = ckpt.load(ckpt_dir, {"extra": None})["extra"]
    torch.manual_seed(123)  # not the imported weights: the checkpoint must overwrite every one
    model = GPT2LMHeadModel(GPT2Config(**extra["model_config"])).eval()
    ranks, plan = ([0], {}) if layout == "single" else ([0, 1], {**GPT_TP, **GPT_TP_PINS})
    p = sc.placement("cpu", ranks)
    sc.distribute_module(model, p, plan)
    ckpt.load(ckpt_dir, {"model": model.state_dict()})
    x = sc.distribute(tokens, p, Broadcast())
    with torch.no_grad():
        out = [model(x)[0].full_tensor()]
    if export_root is not None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(x, x)[1].backward()
        opt.step()
        ckpt.save(export_root, 1, {"model": model.state_dict(), "step": 1, "extra": extra}, tied=TIED)
        with torch.no_grad():
            out.append(model(x)[0].full_tensor())
    return out if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf")
    hf = _hf_model()
    hf.save_pretrained(str(base / "hf"))
    assert os.path.isfile(base / "hf" / "model.safetensors")
    assert convert_hf.main(["import", str(base / "hf"), str(base / "ckpt")]) == 0
    with torch.no_grad():
        logits = hf(_tokens()).logits
    return base, logits


def test_import_gives_transformers_logits_single(imported):
    base, hf_logits = imported
    ours = get_pool(WORLD).run(our_logits, str(base / "ckpt"), "single", _tokens())[0][0]
    assert (ours - hf_logits).abs().max().item() <= TOL


def test_import_tp2_then_export_round_trip(imported):
    base, hf_logits = imported
    export_root = str(base / "tp2_run" / "checkpoints")
    ours, trained = get_pool(WORLD).run(our_logits, str(base / "ckpt"), "tp2", _tokens(), export_root)[0]
    assert (ours - hf_logits).abs().max().item() <= TOL
    assert (trained - ours).abs().max().item() > 1e-3  # the step changed the model
    run_tok = _run_tokenizer(base / "tp2_run")
    # The run directory (its checkpoints/ subdirectory) exports; transformers reproduces our logits.
    assert convert_hf.main(["export", str(base / "tp2_run"), str(base / "hf_out")]) == 0
    with open(base / "hf_out" / "config.json") as f:
        config = json.load(f)
    assert config["tie_word_embeddings"] and config["n_head"] == 4 and config["model_type"] == "gpt2"
    back = _transformers().GPT2LMHeadModel.from_pretrained(str(base / "hf_out")).eval()
    with torch.no_grad():
        theirs = back(_tokens()).logits
    assert (theirs - trained).abs().max().item() <= TOL
    # The run's tokenizer is beside the weights, and transformers encodes with it as the run does.
    exported = base / "hf_out" / "tokenizer.json"
    assert exported.read_bytes() == (base / "tp2_run" / "tokenizer.json").read_bytes()
    text = "def g(y):\n    return y * 2  # é"
    want = run_tok.encode(text, add_special_tokens=False).ids
    fast = _transformers().PreTrainedTokenizerFast(tokenizer_file=str(exported))
    auto = _transformers().AutoTokenizer.from_pretrained(str(base / "hf_out"))
    assert fast(text, add_special_tokens=False).input_ids == want
    assert auto(text, add_special_tokens=False).input_ids == want and auto.decode(want) == text


def test_bin_import_equals_safetensors_import(imported, tmp_path):
    base, _ = imported
    hf_dir = tmp_path / "hf_bin"
    os.makedirs(hf_dir)
    hf = _hf_model()
    torch.save(hf.state_dict(), hf_dir / "pytorch_model.bin")
    hf.config.to_json_file(str(hf_dir / "config.json"))
    convert_hf.main(["import", str(hf_dir), str(tmp_path / "ckpt")])
    a = ckpt.load(str(tmp_path / "ckpt"), {"model": None})["model"]
    b = ckpt.load(str(base / "ckpt"), {"model": None})["model"]
    assert sorted(a) == sorted(b) == sorted(hf_gpt2.expected_names(hf_gpt2.config_from_hf(hf.config.to_dict())))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(a["lm_head.weight"], a["transformer.wte.weight"])


def test_export_without_recorded_config_needs_n_head(imported, tmp_path):
    base, hf_logits = imported
    model = ckpt.load(str(base / "ckpt"), {"model": None})["model"]
    ckpt.save(str(tmp_path / "bare"), 0, {"model": model}, tied=TIED)
    with pytest.raises(ValueError, match="--n-head"):
        convert_hf.main(["export", str(tmp_path / "bare"), str(tmp_path / "out")])
    convert_hf.main(["export", str(tmp_path / "bare"), str(tmp_path / "out"), "--n-head", "4"])
    assert not (tmp_path / "out" / "tokenizer.json").exists()  # no run directory, no tokenizer
    back = _transformers().GPT2LMHeadModel.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        assert (back(_tokens()).logits - hf_logits).abs().max().item() <= TOL


def test_qkv_permutation_groups_heads():
    perm = hf_gpt2.qkv_permutation(n_embd=8, n_head=2)  # head size 4
    # ours: [q_0 k_0 v_0 q_1 k_1 v_1]; HF: [q_0 q_1 | k_0 k_1 | v_0 v_1]
    assert perm.tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]


def test_unsupported_hf_options_are_named():
    cfg = _hf_model().config.to_dict()
    cfg["activation_function"] = "relu"
    with pytest.raises(ValueError, match="activation_function='relu'"):
        hf_gpt2.config_from_hf(cfg)


# -- a vocabulary no tp divides: padded rows (model.make_vocab_size_divisible_by) --------------------------------

ODD = 101  # prime: tp2 needs its rows padded (to 104 with a multiple of 8)


def test_padded_vocabulary_under_tp2_matches_transformers_and_its_own_training(tmp_path):
    """HF GPT-2 with 101 tokens, imported with its rows padded to 104, under tp2 (52 rows per rank): our logits
    are transformers' on the 101 real ids and -inf on the padded ones. After one AdamW step each (ours under tp2,
    transformers on its own model), the logits still agree; the export drops the padded rows."""
    hf = _hf_model(ODD)
    hf.save_pretrained(str(tmp_path / "hf"))
    _run_tokenizer(tmp_path / "hf")  # the tokenizer the weights go with: import keeps it beside the checkpoints
    assert convert_hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "ckpt"),
                            "--make-vocab-size-divisible-by", "8"]) == 0
    assert tokenizer_of_weights(str(tmp_path / "ckpt" / "step_0")) == str(tmp_path / "ckpt" / "tokenizer.json")
    assert (tmp_path / "ckpt" / "tokenizer.json").read_bytes() == (tmp_path / "hf" / "tokenizer.json").read_bytes()
    model = ckpt.load(str(tmp_path / "ckpt"), {"model": None})["model"]
    assert model["transformer.wte.weight"].shape == (104, 64)
    assert not model["transformer.wte.weight"][ODD:].any()
    x = _tokens(ODD)
    export_root = str(tmp_path / "run" / "checkpoints")
    ours, trained = get_pool(WORLD).run(our_logits, str(tmp_path / "ckpt"), "tp2", x, export_root)[0]
    with torch.no_grad():
        want = hf(x).logits
    assert ours.shape[-1] == 104 and torch.isneginf(ours[..., ODD:]).all()
    assert (ours[..., :ODD] - want).abs().max().item() <= TOL
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-2)  # the reference trains on its own
    hf(x, labels=x).loss.backward()
    opt.step()
    with torch.no_grad():
        want = hf(x).logits
    assert (trained[..., :ODD] - want).abs().max().item() <= TOL and torch.isneginf(trained[..., ODD:]).all()
    assert convert_hf.main(["export", str(tmp_path / "run"), str(tmp_path / "hf_out")]) == 0
    back = _transformers().GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf_out")).eval()
    assert back.config.vocab_size == ODD and back.transformer.wte.weight.shape == (ODD, 64)
    with torch.no_grad():
        assert (back(x).logits - want).abs().max().item() <= TOL


def _step_collectives(vocab_size, multiple):
    """Worker: the collectives of one tp2 forward and backward of a GPT-2 with ``vocab_size`` padded to ``multiple``."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_positions=32, n_embd=64, n_layer=1, n_head=4,
                                       embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0,
                                       make_vocab_size_divisible_by=multiple))
    p = sc.placement("cpu", [0, 1])
    sc.distribute_module(model, p, {**GPT_TP, **GPT_TP_PINS})
    x = sc.distribute(_tokens(ODD), p, Broadcast())
    with sc.comm_ledger() as ledger:
        model(x, x)[1].backward()
    return [(r.op, r.bytes) for r in ledger.records]


def test_padding_mask_adds_no_communication():
    """The padded ids' mask (a ``B`` buffer) is sliced to each rank's vocabulary shard, never the logits gathered:
    101 tokens padded to 104 rows communicate exactly what 104 unpadded tokens do."""
    padded, plain = (get_pool(WORLD).run(_step_collectives, v, m)[0] for v, m in ((ODD, 8), (104, 1)))
    assert padded == plain and {op for op, _ in padded} == {"all_reduce"}
