"""A recipe and its config as the search sees them: valid strategies, rehearsed stages, per-op choices.

``RecipeSearchModel(recipe, cfg)`` gives ``toolkit.search``:

- ``problems(strategy)``: why a strategy cannot run (``toolkit.config.validate``
  with its degrees and micro-batch size, plus the per-op layouts' divisibility);
- ``trace(strategy, stage)``: the stage's rehearsed step
  (``toolkit.search.stage_trace``), cached by what the stage sees (degrees
  on its mesh, ZeRO, micro-batch, sequence parallel, its position, its
  layers and the op choices that touch its parameters). A stage with more
  than ``direct_blocks`` repeated layers and layer-uniform choices is priced
  from rehearsals with 2 and 3 layers: every further layer adds what the
  third added (``toolkit.search.extrapolate``);
- ``choices``: the per-op choice points — each module the recipe's
  tensor-parallel plan names (per layer when ``per_layer``), with the
  tp-axis SBPs its parameters may take (``B`` or a split of a dim that
  divides by tp); a tied parameter is one choice for all its names.
"""
from __future__ import annotations

import fnmatch
import random
import re
from dataclasses import dataclass, replace

import torch

from toolkit.search.rehearsal import GlobalOp, fake_tensors
from toolkit.search.stage_trace import StageTrace, trace_stage
from toolkit.search.strategy import Strategy, parse_sbp
from toolkit.config import ConfigError, typed, validate
from toolkit.recipe import data_shard
from toolkit.stages import layer_paths, stage_ranges

from .extrapolate import extrapolate
from .stage_spec import mesh_plan, stage_layers, stage_spec, strategy_cfg

_INDEX = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class OpChoice:
    """One per-op choice point: parameter patterns set together, and their candidate tp-axis SBPs."""

    name: str  # module pattern, e.g. "transformer.h.*.mlp.c_fc" (or one layer's module)
    params: tuple  # ((parameter pattern, global shape), ...)
    candidates: tuple  # ((sbp per param, ...), ...) -- index 0 is the recipe's own


def _layer_uniform(pattern: str) -> bool:
    return _INDEX.search(pattern) is None


def _signature(layer) -> tuple:
    """What makes two repeated layers alike for pricing: their parameters' and buffers' names and shapes."""
    return tuple((n, tuple(t.shape)) for n, t in [*layer.named_parameters(), *layer.named_buffers()])


class RecipeSearchModel:
    def __init__(self, recipe, cfg, per_layer: bool | None = None, direct_blocks: int = 3):
        self.recipe = recipe
        self.cfg = cfg = typed(cfg, recipe)
        self.global_batch = int(cfg.trainer.global_batch_size)
        self.grad_clip = float(cfg.trainer.grad_clip) > 0
        self.split = recipe.pipeline_plan(cfg.model)
        self.n_layer = recipe.n_layers(cfg.model) if self.split is not None else 0
        self.direct_blocks = direct_blocks
        self.per_layer = self.n_layer <= 8 if per_layer is None else per_layer
        with fake_tensors():  # shapes only, however big the model
            model = recipe.build_model(cfg.model)
        self.shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
        self.layer_paths = layer_paths(model, self.split) if self.split is not None else []
        # A deep stage is priced from rehearsals of 2 and 3 of its layers only when every layer is alike
        # (the same parameter and buffer shapes: GPT-2's blocks, not a ResNet's, whose widths change).
        self.layers_alike = len({_signature(model.get_submodule(p)) for p in self.layer_paths}) <= 1
        self.tied = [tuple(t) for t in recipe.tied_pairs(cfg.model)]
        self._traces: dict = {}
        self.rehearsals = 0
        self.choices = self._choices(model)

    def data_shards(self, dp: int, tp: int) -> int:
        """How many shards a micro-batch is cut into on a ``(dp, tp)`` mesh (the recipe's ``data_sbp``)."""
        return data_shard(self.recipe.data_sbp, (dp, tp), (0, 0))[1]

    def micro_batches(self, strategy: Strategy) -> int:
        return self.global_batch // (strategy.micro_batch_size * self.data_shards(strategy.dp, strategy.tp))

    # -- per-op choices ------------------------------------------------------------------------

    def _choices(self, model) -> list:
        plan = self.recipe.mesh_plan(strategy_cfg(self.cfg, self.recipe, Strategy()))
        modules = sorted({k.rsplit(".", 1)[0] for k in plan if ":" not in k})
        out = []
        for pattern in modules:
            names = [n for n, _ in model.named_modules() if fnmatch.fnmatchcase(n, pattern)]
            groups = [names] if not self.per_layer else [[n] for n in names]
            for group in groups:
                key = group[0] if self.per_layer else pattern
                params = []
                for n, p in model.named_parameters(remove_duplicate=False):
                    owner, _, leaf = n.rpartition(".")
                    if owner in group:
                        pat = n if self.per_layer else f"{pattern}.{leaf}"
                        if (pat, tuple(p.shape)) not in params:
                            params.append((pat, tuple(p.shape)))
                if params:
                    out.append(OpChoice(key, tuple(params), self._candidates(plan, params)))
        return self._merge_tied(out)

    @staticmethod
    def _candidates(plan, params) -> tuple:
        own = []
        for pat, _ in params:
            hit = next((v for k, v in plan.items() if ":" not in k and fnmatch.fnmatchcase(pat, k)), None)
            own.append(repr(hit[1]) if hit is not None else "B")
        per = [["B"] + [f"S({d})" for d in range(len(shape))] for _, shape in params]
        combos = [()]
        for opts in per:
            combos = [c + (o,) for c in combos for o in opts]
        combos = [tuple(own)] + [c for c in combos if c != tuple(own)]
        return tuple(combos)

    def _merge_tied(self, choices: list) -> list:
        """Choices whose parameters are tied to each other's become one (the same SBP for all names)."""
        tied_names = {n: g for g in self.tied for n in g}
        out, used = [], set()
        for c in choices:
            if c.name in used:
                continue
            pats = {p for p, _ in c.params}
            partner = next((d for d in choices if d is not c and d.name not in used and any(
                tied_names.get(a) and any(fnmatch.fnmatchcase(b, q) for b in tied_names[a] for q, _ in d.params)
                for a in pats)), None)
            if partner is None:
                out.append(c)
                continue
            used |= {c.name, partner.name}
            params = c.params + partner.params
            candidates = tuple(a + a for a in c.candidates if len(a) == 1) or c.candidates
            out.append(OpChoice(f"{c.name}+{partner.name}", params, candidates))
        return out

    def apply_choice(self, strategy: Strategy, choice: OpChoice, index: int) -> Strategy:
        for (pat, _), sbp in zip(choice.params, choice.candidates[index]):
            strategy = strategy.with_op(pat, None if index == 0 else sbp)
        return strategy

    def op_changes(self, base: Strategy, n: int, seed: int = 0) -> list:
        """``n`` distinct strategies that differ from ``base`` in one per-op layout (the search's op move), rehearsed.

        A layout the configuration rejects or the dispatcher refuses while
        rehearsing is skipped, as the search rejects it; ``ValueError`` when
        ``50 n`` draws do not find ``n``.
        """
        rng, out, tries = random.Random(seed), [], 0
        while len(out) < n:
            tries += 1
            if tries > 50 * n:
                raise ValueError(f"{base.describe()}: found {len(out)} of {n} valid per-op changes in {tries - 1} draws")
            choice = rng.choice(self.choices)
            s = self.apply_choice(base, choice, rng.randrange(1, len(choice.candidates)))
            if s == base or s in out or self.problems(s):
                continue
            try:
                for stage in range(s.stages):
                    self.trace(s, stage)  # rehearse now: predictions then price cached traces
            except (ValueError, RuntimeError, NotImplementedError):
                continue
            out.append(s)
        return out

    # -- validity -----------------------------------------------------------------------------

    def problems(self, strategy: Strategy) -> list:
        out = []
        try:
            cfg = strategy_cfg(self.cfg, self.recipe, strategy)
            # The run's checkpoints are alike for every candidate: validated once, with the plan chosen.
            cfg.trainer.resume, cfg.trainer.init_from = "none", None
            validate(cfg, self.recipe, world_size=strategy.world)
        except ConfigError as err:
            out += err.problems
        for pat, sbp in strategy.ops:
            s = parse_sbp(sbp)
            shape = next((v for n, v in self.shapes.items() if fnmatch.fnmatchcase(n, pat)), None)
            if shape is None:
                out.append(f"op override {pat!r} matches no parameter")
            elif s.is_split and (s.axis >= len(shape) or shape[s.axis] % strategy.tp):
                out.append(f"op override {pat}={sbp}: dim of {shape} does not divide by tp={strategy.tp}")
        return out

    # -- rehearsed stages ---------------------------------------------------------------------

    def _stage_names(self, strategy: Strategy, stage: int) -> set:
        """Parameter names on ``stage``: its layers', the pipeline's first modules' on stage 0, last ones' on the last."""
        pipe = self.split
        if pipe is None:
            return set(self.shapes)
        r = stage_ranges(self.n_layer, strategy.stages)[stage]

        def under(n, paths):
            return any(n.startswith(p + ".") for p in paths)

        out = set()
        for n in self.shapes:
            i = next((i for i, path in enumerate(self.layer_paths) if n.startswith(path + ".")), None)
            if i is not None:
                keep = i in r
            elif under(n, pipe.get("first", ())):
                keep = stage == 0
            elif under(n, pipe.get("last", ())):
                keep = stage == strategy.stages - 1
            else:
                keep = True
            if keep:
                out.add(n)
        return out

    def _ops_for(self, strategy: Strategy, stage: int, names: set) -> tuple:
        return tuple((p, s) for p, s in strategy.ops if any(fnmatch.fnmatchcase(n, p) for n in names))

    def trace(self, strategy: Strategy, stage: int) -> StageTrace:
        pp = strategy.stages
        layers = stage_layers(self.recipe, self.cfg, pp, stage)
        ops = self._ops_for(strategy, stage, self._stage_names(strategy, stage))
        uniform = self.layers_alike and all(_layer_uniform(p) for p, _ in ops)
        where = (stage == 0, stage == pp - 1)
        common = (strategy.dp, strategy.tp, strategy.zero, strategy.micro_batch_size, strategy.sequence_parallel,
                  where, ops)
        if len(layers) > self.direct_blocks and uniform:
            key = common + (len(layers),)
            if key not in self._traces:
                shallow = [self._rehearse(strategy, stage, layers[:b], ops, common + (("layers", b),)) for b in (2, 3)]
                out = extrapolate(shallow[0], shallow[1], len(layers))
                self._traces[key] = out if out is not None else self._rehearse(strategy, stage, layers, ops, key)
            return self._traces[key]
        key = common + ((len(layers),) if uniform else (layers.start, layers.stop))
        return self._rehearse(strategy, stage, layers, ops, key)

    def _rehearse(self, strategy, stage, layers, ops, key) -> StageTrace:
        got = self._traces.get(key)
        if got is None:
            spec = stage_spec(self.recipe, self.cfg, replace(strategy, ops=ops), stage, layers)
            got = self._traces[key] = trace_stage(spec)
            self.rehearsals += 1
        return got

    def tied_bytes(self, strategy: Strategy):
        """Bytes of one tied gradient copy on a rank (what the first and last stage exchange), or None."""
        if not self.tied or strategy.pp == 1 or strategy.stage_rank(0) == strategy.stage_rank(strategy.stages - 1):
            return None
        plan = mesh_plan(self.recipe, self.cfg, strategy)
        total = 0
        for group in self.tied:
            name = group[0]
            sbp = next((v for k, v in plan.items() if ":" not in k and fnmatch.fnmatchcase(name, k)), None)
            n = 1
            for d in self.shapes[name]:
                n *= d
            tp_split = sbp is not None and sbp[1].is_split and strategy.tp > 1
            total += 4 * (n // strategy.tp if tp_split else n)
        return total


def forward_table(trace: StageTrace) -> list:
    """``GlobalOp`` rows of the stage's forward (the per-op SBP table)."""
    return [g for g in trace.phases["F"].global_ops if isinstance(g, GlobalOp)]
