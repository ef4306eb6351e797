"""``validate``: every rule fails with the field, the value and what would be valid."""
from __future__ import annotations

import pytest

from recipes.gpt2.recipe import RECIPE as GPT2
from toolkit.config import ConfigError, ConfigWarning, compose
from toolkit.config import validate as validate_for
from toolkit.config.validate import layouts_for


def validate(cfg, world_size=None):
    return validate_for(cfg, GPT2, world_size=world_size)

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS_PER_NODE")


@pytest.fixture(autouse=True)
def _not_launched(monkeypatch):
    """Tests start from a plain (non-torchrun, non-Slurm) environment."""
    for key in LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)


def cfg_of(*overrides):
    return compose(list(overrides), run_dir="/tmp/run")


def problems(*overrides, world_size=None):
    with pytest.raises(ConfigError) as info:
        validate(cfg_of(*overrides), world_size=world_size)
    assert isinstance(info.value, ValueError)
    return "\n".join(info.value.problems)


@pytest.mark.parametrize("layout, world, accumulation, stages", [
    ("single", 1, 8, (4,)),
    ("dp2", 2, 4, (4,)),
    ("dp2_tp2_pp2", 8, 4, (2, 2)),
    ("dp2_tp4_pp2", 16, 4, (2, 2)),
    ("dp4_zero2", 4, 2, (4,)),
    ("tp4_pp4", 16, 8, (1, 1, 1, 1)),
])
def test_valid_layouts(layout, world, accumulation, stages):
    job = validate(cfg_of(f"parallel={layout}", "trainer.global_batch_size=32"))
    assert (job.name, job.world_size, job.accumulation, job.stage_layers) == (layout, world, accumulation, stages)
    assert job.device == "cpu" and job.launched is None
    assert job.items_per_step == 32 * 256 and job.data_shards == job.dp


def test_world_size_must_match():
    text = problems("parallel=dp2_tp2", world_size=8)
    assert "dp*tp*pp = 2*2*1 = 4 processes, but 8 are available" in text
    assert "dp8" in text and "dp2_tp4" in text  # layouts that would fit


def test_world_size_from_torchrun_environment(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert validate(cfg_of("parallel=dp2")).launched == "torchrun"
    text = problems("parallel=dp4")
    assert "torchrun's WORLD_SIZE is 2" in text


def test_world_size_from_slurm_environment(monkeypatch):
    for key, value in dict(SLURM_PROCID="1", SLURM_LOCALID="1", SLURM_STEP_NUM_TASKS="4",
                           SLURM_STEP_NODELIST="node[01-02]", SLURM_JOB_ID="77").items():
        monkeypatch.setenv(key, value)
    assert validate(cfg_of("parallel=tp2_pp2")).launched == "slurm"
    assert "Slurm's SLURM_STEP_NUM_TASKS is 4" in problems("parallel=dp2")


def test_heads_and_vocab_divide_by_tp():
    text = problems("parallel=tp3")
    assert "model.n_head=4: must divide by parallel.tp=3" in text and "valid tp: [1, 2, 4]" in text
    assert "model.vocab_size=8192 (embedding rows: 8192) must divide by parallel.tp=3" in text
    # the padded suggestion: a multiple of 128 * 3
    assert "model.make_vocab_size_divisible_by=384 (8448 rows)" in text


def test_gpt2_vocab_rows_are_padded_for_tp():
    # The presets pad GPT-2's 50257 tokens to 50304 rows (make_vocab_size_divisible_by=128): tp2 and tp8 divide.
    assert validate(cfg_of("model=gpt2", "parallel=tp2")).tp == 2
    assert validate(cfg_of("model=gpt2-medium", "parallel=tp8")).tp == 8
    text = problems("model=gpt2", "parallel=tp2", "model.make_vocab_size_divisible_by=1")
    assert "model.vocab_size=50257 (embedding rows: 50257) must divide by parallel.tp=2" in text
    assert "model.make_vocab_size_divisible_by=128 (50304 rows)" in text
    assert "model.make_vocab_size_divisible_by=0: must be >= 1" in problems("model.make_vocab_size_divisible_by=0")


def test_layers_divide_by_pp_or_stage_layers():
    text = problems("parallel=pp3", "trainer.global_batch_size=48")
    assert "model: 4 layers do not divide into parallel.pp*pp_virtual=3" in text
    assert "parallel.stage_layers" in text
    job = validate(cfg_of("parallel=pp3", "trainer.global_batch_size=48", "parallel.stage_layers=[2,1,1]"))
    assert job.stage_layers == (2, 1, 1)


@pytest.mark.parametrize("stages", ["[2,2,0]", "[1,1]", "[2,2,2]"])
def test_bad_stage_layers(stages):
    text = problems("parallel=pp3", "trainer.global_batch_size=48", f"parallel.stage_layers={stages}")
    assert "parallel.stage_layers=" in text and "needs 3 (pp*pp_virtual) entries" in text


def test_virtual_stages_split_the_layers_into_pp_times_pp_virtual():
    job = validate(cfg_of("parallel=pp2", "trainer.global_batch_size=32", "parallel.pp_virtual=2"))
    assert (job.pp_virtual, job.stage_layers) == (2, (1, 1, 1, 1))
    job = validate(cfg_of("parallel=pp2", "parallel.pp_schedule=zb", "parallel.pp_virtual=2"))  # interleaved ZB
    assert (job.pp_virtual, job.stage_layers) == (2, (1, 1, 1, 1))
    assert "model: 4 layers do not divide into parallel.pp*pp_virtual=6" in problems(
        "parallel=pp2", "parallel.pp_virtual=3")


@pytest.mark.parametrize("overrides, fragment", [
    (("parallel=pp2", "parallel.pp_schedule=zbv"), "parallel.pp_schedule=zbv: places two stages per pipeline rank "
     "in a V; needs parallel.pp_virtual=2, got 1"),
    (("parallel=single", "parallel.pp_virtual=2"), "parallel.pp_virtual=2: virtual stages interleave a pipeline; "
     "needs parallel.pp > 1"),
    (("parallel=pp2", "parallel.pp_schedule=zb", "trainer.compile=true"), "trainer.compile=true: "
     "parallel.pp_schedule=zb splits every backward into input and weight gradients"),
])
def test_bad_virtual_and_zero_bubble_configs(overrides, fragment):
    assert fragment in problems(*overrides)


def test_global_batch_divides_by_micro_times_dp():
    text = problems("parallel=dp3", "trainer.global_batch_size=32")
    assert "trainer.global_batch_size=32: must divide by trainer.micro_batch_size*parallel.dp = 4*3 = 12" in text
    assert "e.g. 24 or 36" in text


def test_accumulation_at_least_pp():
    text = problems("parallel=dp2_pp2", "trainer.global_batch_size=8")
    assert "gives 1 micro-batches per step" in text and "fewer than parallel.pp=2" in text
    assert "global_batch_size >= 16" in text


def test_zero_with_dp1_and_sequence_parallel_with_tp1_warn():
    with pytest.warns(ConfigWarning, match="zero=2 with parallel.dp=1"):
        job = validate(cfg_of("parallel=tp2_zero2"))
    assert job.zero == 0
    assert validate(cfg_of("parallel=dp4_zero2")).zero == 2
    with pytest.warns(ConfigWarning, match="sequence_parallel=true with parallel.tp=1 splits the sequence over one"):
        validate(cfg_of("parallel=dp2", "parallel.sequence_parallel=true"))


def test_zero_and_bucket_size_out_of_range_in_field_form():
    assert "parallel.zero=5: unknown choice; valid: 0, 1, 2, 3" in problems("parallel.zero=5")
    assert "parallel.bucket_mb=0.0: gradient MiB per collective, must be > 0" in problems("parallel.bucket_mb=0")


def test_seq_len_within_positions():
    text = problems("data.seq_len=512")
    assert "data.seq_len=512: exceeds model.n_positions=256; valid: 2..256" in text


def test_data_vocab_within_model_vocab():
    assert "data.vocab_size=9000" in problems("data.vocab_size=9000")
    assert validate(cfg_of("data.vocab_size=5000")).world_size == 1
    assert "data.vocab_size=100: the tokenizer trained on the corpus has the 256 bytes and the end-of-text token; " \
           "valid: 257..model.vocab_size" in problems("data.vocab_size=100")


def test_sequence_parallel_needs_seq_len_multiple_of_tp():
    assert validate(cfg_of("parallel=tp2", "parallel.sequence_parallel=true")).tp == 2
    text = problems("parallel=tp4", "parallel.sequence_parallel=true", "data.seq_len=130")
    assert "data.seq_len=130: sequence_parallel splits it over parallel.tp=4" in text


def test_context_parallel_needs_seq_len_multiple_of_its_split():
    lay = validate(cfg_of("parallel=dp2_cp2", "data.seq_len=64"))
    assert (lay.dp, lay.cp, lay.world_size, lay.data_shards, lay.name) == (2, 2, 4, 2, "dp2_cp2")
    assert "data.seq_len=66: context parallelism splits it over parallel.cp=4; valid: a multiple of 4" in \
        problems("parallel=cp4", "data.seq_len=66")
    text = problems("parallel=cp2_tp4", "parallel.sequence_parallel=true", "data.seq_len=68")
    assert "splits it over parallel.cp=2 times parallel.tp=4 (sequence_parallel); valid: a multiple of 8" in text
    assert "dp*cp*tp*pp = 1*2*1*1 = 2 processes, but 4 are available" in problems("parallel=cp2", world_size=4)


def test_context_parallel_of_several_samples_per_micro_batch_warns():
    with pytest.warns(ConfigWarning, match="parallel.cp=2 with trainer.micro_batch_size=2: torch's linear layers fold"):
        validate(cfg_of("parallel=cp2", "trainer.micro_batch_size=2", "trainer.global_batch_size=8"))


def test_context_parallel_is_refused_with_compile():
    assert "trainer.compile=true: compiles the stage forwards that run on plain tensors, and with cp=2" in \
        problems("parallel=cp2", "trainer.compile=true")


def test_the_search_refuses_context_parallelism_before_searching():
    """train.py resolves parallel.auto before it validates: the refusal must come before any search or cached plan
    (a plan for dp, tp and pp would run on cp times its processes)."""
    from toolkit.search.auto import resolve, search_plan

    for search in (resolve, search_plan):  # train.py's parallel=auto, and scripts/search_plan.py
        with pytest.raises(ConfigError, match="parallel.cp=2 with parallel.auto=true: the search lays out dp, tp"):
            search(cfg_of("parallel.cp=2", "parallel.auto=true"), GPT2, log=pytest.fail)


@pytest.mark.parametrize("name", ["insightface", "wide_deep"])
def test_context_parallel_is_refused_where_the_recipe_has_no_sequence(name):
    from recipes.registry import get

    with pytest.raises(ConfigError) as info:
        validate_for(cfg_of(f"recipe={name}", "parallel=cp2"), get(name))
    assert f"parallel.cp=2: splits the sequence, and recipe {name} has none" in "\n".join(info.value.problems)


@pytest.mark.parametrize("name", ["insightface", "wide_deep"])
def test_sequence_parallel_is_refused_where_the_plan_has_no_such_variant(name):
    from recipes.registry import get

    with pytest.raises(ConfigError) as info:
        validate_for(cfg_of(f"recipe={name}", "parallel=tp2", "parallel.sequence_parallel=true"), get(name))
    assert f"parallel.sequence_parallel=true: recipe {name}'s plan has no sequence-parallel variant" in \
        "\n".join(info.value.problems)


def test_insightface_refuses_a_plan_entry_for_its_class_centres():
    """The class centres and their ids keep their class split: Partial FC's sampling and row steps (on the
    ZeRO master too) index it. Entries for the backbone pass."""
    from recipes.registry import get

    insightface = get("insightface")
    cfg = cfg_of("recipe=insightface", "parallel=dp2_tp2")
    cfg.parallel.plan = {"head.*": "B"}
    with pytest.raises(ConfigError) as info:
        validate_for(cfg, insightface)
    assert "parallel.plan=['head.*']: the class centres and their ids keep their class split" in \
        "\n".join(info.value.problems)
    cfg.parallel.plan = {"backbone.conv1.weight": "S(0)"}
    assert validate_for(cfg, insightface).world_size == 4


@pytest.mark.parametrize("override, fragment", [
    ("recipe.name=bert", "recipe.name='bert': does not name the recipe validated against, 'gpt2'"),
    ("trainer.optimizer=lamb", "trainer.optimizer='lamb': unknown choice; valid: adamw, sgd"),
    ("trainer.momentum=1.5", "trainer.momentum=1.5: must be in [0, 1)"),
    ("device=tpu", "device='tpu': unknown choice; valid: auto, cpu, cuda"),
    ("parallel.pp_schedule=zb1p", "parallel.pp_schedule='zb1p': unknown choice; valid: 1f1b, gpipe, looped_bfs, zb, zbv"),
    ("trainer.precision=fp8", "trainer.precision='fp8': unknown choice; valid: fp32, bf16, fp16"),
    ("parallel=tp2 trainer.compile=true", "trainer.compile=true: compiles the stage forwards that run on plain "
     "tensors, and with tp=2 every stage runs on global tensors"),
    ("trainer.resume=latest", "trainer.resume='latest': unknown choice; valid: none, auto"),
    ("data.source=web", "data.source='web': unknown choice; valid: stdlib, text"),
    ("logger.backend=tb", "logger.backend='tb': unknown choice; valid: wandb, none"),
    ("logger.mode=sometimes", "logger.mode='sometimes': unknown choice"),
    ("model.n_head=3", "model.n_embd=128: must divide by model.n_head=3"),
    ("model.dropout=1.0", "model.dropout=1.0: must be in [0, 1)"),
    ("trainer.min_lr=1.0", "trainer.min_lr=1.0: must be in [0, trainer.lr=0.0006]"),
    ("trainer.warmup_steps=-1", "trainer.warmup_steps=-1: must be >= 0"),
    ("trainer.betas=[0.9]", "trainer.betas=[0.9]: must be two numbers in [0, 1)"),
    ("trainer.micro_batch_size=0", "trainer.micro_batch_size=0: must be >= 1"),
    ("trainer.grad_clip=-1", "trainer.grad_clip=-1.0: must be >= 0.0 (0 disables clipping)"),
    ("trainer.peak_tflops=0", "trainer.peak_tflops=0.0: must be > 0, or null to measure it"),
    ("data.val_fraction=1", "data.val_fraction=1.0: must be in [0, 1)"),
    ("data.val_fraction=0", "data.val_fraction=0.0: holds out nothing, but trainer.eval_every=50"),
    ("trainer.init_from=gpt2", "trainer.init_from='gpt2': the checkpoint has"),
])
def test_choices_and_ranges(override, fragment):
    assert fragment in problems(*override.split())


def test_text_data_needs_a_path():
    assert "data.path=None: data.source=text needs a path" in problems("data=text")
    assert validate(cfg_of("data.val_fraction=0", "trainer.eval_every=0")).world_size == 1


def test_missing_data_tokenizer_and_weights_paths_are_refused(tmp_path):
    missing = str(tmp_path / "nothing")
    text = problems("data=text", f"data.path={missing}", f"data.tokenizer={missing}/tokenizer.json",
                    f"trainer.init_from={missing}")
    assert f"data.path={missing!r}: no such file or directory" in text
    assert f"data.tokenizer='{missing}/tokenizer.json': no such file" in text
    assert f"trainer.init_from={missing!r}: no such file or directory;" in text
    (tmp_path / "corpus.txt").write_text("some text")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert validate(cfg_of("data=text", f"data.path={tmp_path}/corpus.txt",
                           f"data.tokenizer={tmp_path}/tokenizer.json")).world_size == 1
    # Not a path but a hub dataset name (recipes.gpt2.data.source.open_corpus): looked up when read.
    assert validate(cfg_of("data=text", "data.path=some_user/some_dataset_name")).world_size == 1
    assert "no such file or directory" in problems("data=text", "data.path=corpus_here.txt")


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face hub cache; ``add(name)`` puts a snapshot of ``name`` with GPT-2 small's config.json
    and its tensors' headers (``tests.hf_stand_in``) in it."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))

    def add(name):
        repo = cache / ("models--" + name.replace("/", "--"))
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text("0" * 40)
        snap = repo / "snapshots" / ("0" * 40)
        snap.mkdir(parents=True)
        (snap / "config.json").write_text('{"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, '
                                          '"n_positions": 1024}')  # GPT-2 small's
        from recipes.gpt2.recipe import RECIPE
        from tests.hf_stand_in import hf_shapes, write_headers
        from toolkit.config import compose

        write_headers(snap / "model.safetensors", hf_shapes(RECIPE, compose(["model=gpt2"], run_dir=str(tmp_path)).model))
        return str(snap)

    return add


def test_a_published_gpt2_name_resolves_to_the_local_hub_cache(hub_cache):
    text = problems("model=gpt2", "trainer.init_from=gpt2")
    assert "trainer.init_from='gpt2': no such file or directory (nor a name recipe gpt2 resolves)" in text
    snap = hub_cache("openai-community/gpt2")
    assert validate(cfg_of("model=gpt2", "trainer.init_from=gpt2")).world_size == 1
    assert GPT2.weights_path("gpt2") == snap
    assert GPT2.weights_path("gpt2-medium") is None
    assert "trainer.init_from='gpt2'" in problems("model=gpt2", "trainer.init_from=gpt2", "model.vocab_size=50304")


def test_all_problems_are_reported_at_once():
    with pytest.raises(ConfigError) as info:
        validate(cfg_of("parallel=tp3", "trainer.precision=fp8", "data.seq_len=999"))
    assert len(info.value.problems) >= 4
    assert str(info.value).startswith(f"{len(info.value.problems)} configuration problems:")


def test_device_cuda_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert "device='cuda': 2 local ranks need as many visible CUDA devices, found 0; valid: device=cpu or " \
           "device=auto" in problems("device=cuda", "parallel=dp2")


def test_a_cuda_pipeline_with_one_device_connection_warns(monkeypatch):
    import warnings

    from toolkit.config import environment

    monkeypatch.setattr(environment, "cuda_device_count", lambda: 8)  # as on a machine with 8 GPUs
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.warns(ConfigWarning, match="CUDA_DEVICE_MAX_CONNECTIONS=1 .* unset it for pipeline jobs"):
        assert validate(cfg_of("device=cuda", "parallel=dp2_pp2")).device == "cuda"
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        validate(cfg_of("device=cuda", "parallel=dp2"))  # no pipeline: no channels
        validate(cfg_of("device=cpu", "parallel=dp2_pp2"))  # gloo
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
        validate(cfg_of("device=cuda", "parallel=dp2_pp2"))


def test_validate_accepts_plain_dicts_and_does_not_modify():
    cfg = cfg_of("parallel=dp4_zero2")
    before = cfg.copy()
    validate(cfg)
    assert cfg == before
    schedule = {"lr": 1e-3, "min_lr": 0.0, "warmup_steps": 0}  # the recipe's trainer group sets them
    assert validate({"parallel": {"dp": 2}, "data": {"seq_len": 128}, "trainer": schedule}).world_size == 2
    assert "trainer.lr: not set; the recipe's trainer group sets it" in "\n".join(
        pytest.raises(ConfigError, validate, {"parallel": {"dp": 2}, "data": {"seq_len": 128}}).value.problems)


def test_layouts_for():
    assert layouts_for(4) == ["dp4", "pp4", "tp4", "dp2_pp2", "dp2_tp2", "tp2_pp2"]
    assert layouts_for(1) == ["single"]


def test_init_from_a_checkpoint_of_other_shapes_or_corrupt_is_refused_before_spawning(tmp_path):
    """``trainer.init_from``'s model tensors are checked against the model's shapes from the checkpoint's
    metadata alone (no tensor read), and a corrupt manifest or a directory that holds no weights is named,
    before any rank starts."""
    from recipes.gpt2.recipe import RECIPE
    from toolkit import checkpoint as ckpt

    padded = ("model.vocab_size=1001", "model.make_vocab_size_divisible_by=8")
    ckpt.save(str(tmp_path / "ck"), 0, {"model": RECIPE.build_model(cfg_of(*padded).model).state_dict()},
              tied=[("transformer.wte.weight", "lm_head.weight")])
    init = f"trainer.init_from={tmp_path / 'ck'}"
    assert validate(cfg_of(*padded, init)).world_size == 1
    text = problems("model.vocab_size=1001", init)
    assert "transformer.wte.weight is [1008, 128] there, [1001, 128] here; valid: the model settings" in text
    assert "; and 49 more; valid" in problems(*padded, "model.n_embd=64", init)  # 52 tensors differ, 3 are named
    n_layer = int(cfg_of(*padded).model.n_layer)  # a deeper model: the checkpoint lacks its last block
    assert f"transformer.h.{n_layer}.ln_1.weight is not there" in problems(*padded, f"model.n_layer={n_layer + 1}", init)
    # A run directory names its checkpoints/; a directory that is neither ours nor a format the recipe reads
    # (a Hugging Face one, for GPT-2) is refused.
    (tmp_path / "ck").rename(tmp_path / "checkpoints")
    assert RECIPE.weights_path(str(tmp_path)) == str(tmp_path / "checkpoints")
    assert validate(cfg_of(*padded, f"trainer.init_from={tmp_path}")).world_size == 1
    (tmp_path / "other").mkdir()
    text = problems(f"trainer.init_from={tmp_path / 'other'}")
    assert "no complete checkpoint here" in text and "or a format recipe gpt2 reads" in text
    (tmp_path / "checkpoints" / "step_0" / "manifest.json").write_text("{")
    assert "not a valid manifest" in problems(*padded, f"trainer.init_from={tmp_path}")


def test_resume_checks_the_runs_newest_checkpoint_before_spawning(tmp_path):
    """``trainer.resume=auto``: the run directory's newest checkpoint is checked as ``init_from``'s is (other
    model settings, a corrupt manifest); a run without one starts from step 0."""
    from recipes.gpt2.recipe import RECIPE
    from toolkit import checkpoint as ckpt
    from toolkit.config import compose

    run = tmp_path / "run"

    def resumed(*overrides):
        return compose([*overrides, "trainer.resume=auto"], run_dir=str(run))

    assert validate(resumed()).world_size == 1  # nothing saved yet
    ckpt.save(str(run / "checkpoints"), 2, {"model": RECIPE.build_model(cfg_of("model.n_embd=64").model).state_dict()},
              tied=[("transformer.wte.weight", "lm_head.weight")])
    assert validate(resumed("model.n_embd=64")).world_size == 1
    with pytest.raises(ConfigError) as info:
        validate(resumed())
    text = "\n".join(info.value.problems)
    assert f"trainer.resume=auto: the model of the run's newest checkpoint ({run}/checkpoints/step_2) has other " \
           "tensors or shapes than model.*: transformer.wte.weight is" in text and "or another run directory" in text
    (run / "checkpoints" / "step_2" / "manifest.json").write_text("{")
    with pytest.raises(ConfigError) as info:
        validate(resumed("model.n_embd=64"))
    assert "trainer.resume=auto: " in info.value.problems[0] and "not a valid manifest" in info.value.problems[0]


def test_resume_refuses_other_facts_than_the_checkpoints(tmp_path):
    """A recipe's ``resume_facts`` (Wide&Deep: how ids hash to rows) are saved with each checkpoint; resuming
    under others is refused before spawning, though every tensor has its shape. A checkpoint without facts
    (saved before they were) is not checked. Another data seed warns."""
    from recipes.registry import get
    from toolkit import checkpoint as ckpt

    wide_deep = get("wide_deep")
    run = tmp_path / "run"
    small = ["recipe=wide_deep", "model.vocab_size=1000", "model.embed_dim=4", "model.hidden=[8]"]

    def resumed(*overrides):
        return compose([*small, *overrides, "trainer.resume=auto"], run_dir=str(run))

    cfg = resumed()
    model = wide_deep.build_model(cfg.model).to_empty(device="cpu").state_dict()  # its tables are built on meta
    ckpt.save(str(run / "checkpoints"), 2, {"model": model, "facts": wide_deep.resume_facts(cfg)})
    assert validate_for(resumed(), wide_deep).world_size == 1
    for override, fact, saved in (("model.hash_seed=7", "model.hash_seed=7", "model.hash_seed=0"),
                                  ("model.field_vocab_sizes=" + str([1000 - 25] + [1] * 25).replace(" ", ""),
                                   "model.field_vocab_sizes=[975, 1, 1", "model.field_vocab_sizes=None")):
        with pytest.raises(ConfigError) as info:
            validate_for(resumed(override), wide_deep)
        (text,) = info.value.problems
        assert text.startswith(f"trainer.resume=auto: {fact}") and \
            f"here, the run's newest checkpoint ({run}/checkpoints/step_2) was saved with {saved}, " in text
        assert text.endswith(f"valid: {saved}, or another run directory (hydra.run.dir)")
    ckpt.save(str(run / "checkpoints"), 3, {"model": model, "sampler": {"step": 3, "seed": cfg.trainer.seed}})
    assert validate_for(resumed("model.hash_seed=7"), wide_deep).world_size == 1
    with pytest.warns(ConfigWarning, match=r"trainer.seed=5, the run's newest checkpoint .* was saved with 1234: the "
                                           "batches from its step on follow the config's seed"):
        validate_for(resumed("trainer.seed=5"), wide_deep)


def test_resume_facts_are_saved_as_plain_data_and_refused_if_they_cannot_be():
    """A config node among a recipe's ``resume_facts`` is saved as plain lists and dicts; a value a checkpoint
    cannot hold is refused before spawning, resuming or not (every checkpoint saves the facts)."""
    import numpy as np
    from omegaconf import OmegaConf

    from recipes.gpt2.recipe import GPT2Recipe
    from toolkit.run_state import resume_facts

    class Facts(GPT2Recipe):
        def __init__(self, facts):
            super().__init__()
            self.facts = facts

        def resume_facts(self, cfg):
            return self.facts

    node = Facts({"model.widths": OmegaConf.create([1, 2]), "model.seed": 3})
    assert resume_facts(node, cfg_of()) == {"model.widths": [1, 2], "model.seed": 3}
    assert validate_for(cfg_of(), node).world_size == 1
    with pytest.raises(ConfigError) as info:
        validate_for(cfg_of(), Facts({"model.table": np.arange(3)}))
    assert "recipe gpt2's resume_facts must be JSON data" in info.value.problems[0]


def test_a_per_op_plan_entry_is_checked_against_the_models_parameters():
    """``parallel.plan``: a pattern that matches no parameter (or, pinning activations, no module), or a split
    past a parameter's dimensions, is refused before spawning (each failed on every rank as the model was
    laid out); an activation pin is not a parameter's split."""
    def plan_problems(plan):
        cfg = cfg_of("parallel=tp2")
        cfg.parallel.plan = plan
        with pytest.raises(ConfigError) as info:
            validate(cfg)
        return "\n".join(info.value.problems)

    assert "parallel.plan['*.mlp.c_fc.weight']='S(5)': transformer.h.0.mlp.c_fc.weight has 2 dimensions; " \
           "valid: B or S(0..1)" in plan_problems({"*.mlp.c_fc.weight": "S(5)"})
    assert "parallel.plan['*.mlp.c_fc.wieght']: matches no parameter or buffer of the model" in plan_problems(
        {"*.mlp.c_fc.wieght": "S(0)"})
    assert "parallel.plan['transformer.h.0.mlp']: matches no parameter or buffer" in plan_problems(
        {"transformer.h.0.mlp": "S(0)"})  # a module: its activations are pinned as '<module>:input'
    assert "after ':' comes input, inputs or output" in plan_problems({"transformer.h.*:inptu": "B"})
    cfg = cfg_of("parallel=tp2")
    cfg.parallel.plan = {"*.mlp.c_fc.weight": "S(0)", "transformer.h.*:input": "S(1)"}
    assert validate(cfg).tp == 2
