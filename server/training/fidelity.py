"""``agentshare finetune --fidelity POINTS``: a module that shares the prefill, never trading
accuracy silently.

Sharing the base's prefill costs a cache-conditioned module some accuracy on tasks the base's KV
does not carry well. This measures that cost on the user's own rows and picks the cheapest layer
split that keeps it within ``POINTS`` percentage points of a module trained on its own prefill:

1. a slice of the rows is held out (seeded); the module and its comparator train on the rest;
2. the comparator: the same module trained on its own prefill (``finetune --standard``);
3. ``k = 0`` (full sharing) is probed first: trained cache-conditioned, answered through the
   engine (the serving path) on the held-out rows, scored against the comparator's answers;
4. if it falls short, the split is bisected over ``(0, L]``: a module that recomputes its top
   ``k`` layers over the prefix is trained and scored per probe. ``k = L`` recomputes every
   layer, which *is* the comparator (a private prefill), so it passes without a probe. The
   search assumes the gap shrinks as ``k`` grows; every probe is kept in the record;
5. verify: the chosen module is answered once more from its output directory, beside the
   comparator in one engine, and those figures go into its manifest (``fidelity``).

The score is exact match (a tool call: equal JSON) where the comparator answers at least
:data:`EXACT_FLOOR` of the held-out rows exactly; otherwise (long, free-form responses) it is
token agreement: the share of the reference response's tokens the greedy answer reproduces at
their positions. The search resumes where it stopped (``OUTPUT/fidelity/search.json``).

>>> gap = Probe(k=0, score=0.91, scores=[1.0] * 91 + [0.0] * 9, seconds=1.0).gap(0.95)
>>> round(gap, 2), within(gap, points=3.0), within(gap, points=5.0)
(4.0, False, True)
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from server.modules.manifest import LoraSpec, Manifest, ModuleKind
from server.training.dataset import DataError, parse_row
from server.training.evaluate import engine_answers, paired_bootstrap
from server.training.tasks import score as task_score
from server.training.trainer import BadOption, FinetuneConfig, _resume_key, finetune

EXACT_FLOOR = 0.2
"""The comparator's exact-match accuracy below which token agreement is the score."""
MIN_HELD_OUT = 20
WORK_DIR = "fidelity"

Train = Callable[[FinetuneConfig], Any]
Answer = Callable[[Path, dict[str, Path], list[Any], int], dict[str, list[str]]]


@dataclass(frozen=True, slots=True)
class FidelityOptions:
    """``points``: the largest accuracy gap (percentage points) to accept against the comparator;
    ``held_out``: a fraction of the rows, or a count, kept out of training to measure it;
    ``step``: the resolution of the split search in layers."""

    points: float
    held_out: float | int = 0.2
    step: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.points <= 100:
            raise BadOption(f"--fidelity {self.points}: give the accepted gap in percentage points, 0..100")
        if self.step < 1:
            raise BadOption(f"--fidelity-step {self.step}: the search's resolution is at least one layer")
        if isinstance(self.held_out, float) and not 0 < self.held_out < 1:
            raise BadOption(f"--fidelity-held-out {self.held_out}: a fraction in (0, 1) or a count of rows")


@dataclass(slots=True)
class Probe:
    """One measured module: its split ``k``, its mean score and per-row scores."""

    k: int
    score: float
    scores: list[float]
    seconds: float

    def gap(self, own: float) -> float:
        """Points below the comparator (positive: worse than its own prefill)."""
        return 100 * (own - self.score)


def within(gap: float, *, points: float) -> bool:
    return gap <= points + 1e-9


@dataclass(slots=True)
class FidelityResult:
    """What the search measured and chose."""

    output: Path
    k: int
    layers: int
    metric: str
    own: float
    shared: float
    ci: tuple[float, float]
    points: float
    rows: dict[str, int]
    probes: list[Probe] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def gap(self) -> float:
        return 100 * (self.own - self.shared)

    @property
    def prefill_saved(self) -> float:
        """Share of the prefix's layer work the module reads from the shared prefill."""
        return 1 - self.k / self.layers

    def record(self) -> dict[str, Any]:
        """The ``fidelity`` field of the manifest."""
        return {"metric": self.metric, "points": self.points, "shared": round(self.shared, 4),
                "own": round(self.own, 4), "gap_points": round(self.gap, 2),
                "ci_points": [round(100 * -self.ci[1], 2), round(100 * -self.ci[0], 2)],
                "recompute_layers": self.k, "layers": self.layers, "rows": self.rows,
                "probes": [{"k": p.k, "score": round(p.score, 4)} for p in self.probes],
                "search_seconds": round(self.seconds, 1)}

    def table(self) -> str:
        """The search as a plain-text table (one line per probe, the choice marked)."""
        unit = "%" if self.metric == "exact" else "% tokens"
        own_mark = "  <- chosen: no split was within the points" if self.k == self.layers else ""
        lines = [f"{'arm':<28} {'k':>4} {'score':>10} {'gap (points)':>13}",
                 f"{'own prefill (comparator)':<28} {self.layers:>4} {100 * self.own:>8.1f} {unit[0]} {'':>13}{own_mark}"]
        for p in sorted(self.probes, key=lambda p: p.k):
            mark = "  <- chosen" if p.k == self.k else ""
            lines.append(f"{'shared prefill':<28} {p.k:>4} {100 * p.score:>8.1f} {unit[0]} {p.gap(self.own):>+13.1f}{mark}")
        lines.append(f"chosen k = {self.k} of {self.layers}: gap {self.gap:+.1f} points "
                     f"(95 % CI {100 * -self.ci[1]:+.1f} .. {100 * -self.ci[0]:+.1f}), within {self.points:g}; "
                     f"{100 * self.prefill_saved:.0f} % of the prefix's layers read from the shared prefill; "
                     f"{self.rows['held_out']} held-out rows, {self.metric} score, {self.seconds:.0f} s")
        if self.resolution > self.points:
            lines.append(f"note: {self.rows['held_out']} held-out rows measure the gap to about "
                         f"±{self.resolution:.1f} points, more than the {self.points:g} asked for; each probe's "
                         "verdict near the line is a coin toss. Give more rows (or --fidelity-held-out) "
                         "for a choice that holds.")
        return "\n".join(lines)

    @property
    def resolution(self) -> float:
        """Half the width of the gap's 95 % CI, in points: what the held-out rows can tell apart."""
        return 100 * (self.ci[1] - self.ci[0]) / 2


def score_rows(predicted: Sequence[str], rows: Sequence[dict[str, Any]], metric: str, tokenizer: Any) -> list[float]:
    """Per-row scores: ``exact`` (a row's ``task`` picks its scorer) or ``tokens`` (agreement)."""
    if metric == "exact":
        return [float(task_score("tool" if r.get("task") == "tool" else "retrieval", p, r["response"]))
                for p, r in zip(predicted, rows, strict=True)]
    out = []
    for p, r in zip(predicted, rows, strict=True):
        ref = tokenizer.encode(r["response"].strip(), add_special_tokens=False)
        got = tokenizer.encode(p.strip(), add_special_tokens=False)
        out.append(sum(a == b for a, b in zip(ref, got, strict=False)) / max(1, len(ref)))
    return out


def smallest_split(passes: Callable[[int], bool], layers: int, step: int = 1) -> int:
    """The smallest layer split ``k`` for which ``passes(k)``, assuming that once a split
    passes, every larger one does: ``k = 0`` first, then a bisection of ``(0, layers]`` to within
    ``step`` layers. ``k = layers`` is never asked: it is the module on its own prefill, which
    passes by definition.

    >>> asked = []
    >>> smallest_split(lambda k: asked.append(k) or k >= 19, 30), asked
    (19, [0, 15, 22, 18, 20, 19])
    >>> smallest_split(lambda k: False, 30, step=8)
    30
    """
    if passes(0):
        return 0
    lo, hi = 0, layers
    while hi - lo > step:
        mid = lo + max(step, (hi - lo) // 2 // step * step)
        if mid >= hi:
            break
        if passes(mid):
            hi = mid
        else:
            lo = mid
    return hi


def split_rows(lines: list[str], opts: FidelityOptions, source: str) -> tuple[list[str], list[str]]:
    """(train, held-out) raw JSONL lines; every row is checked first."""
    for i, line in enumerate(lines, start=1):
        try:
            parse_row(json.loads(line), line=i, source=source)
        except ValueError as exc:
            raise DataError(exc.args[0] if isinstance(exc, DataError) else f"{source}:{i}: not valid JSON ({exc})") from None
    n = len(lines)
    k = round(opts.held_out * n) if isinstance(opts.held_out, float) else int(opts.held_out)
    if k < MIN_HELD_OUT or n - k < MIN_HELD_OUT:
        raise DataError(f"{source}: {n} rows; --fidelity holds out {k} and trains on {n - k}, and needs at "
                        f"least {MIN_HELD_OUT} of each to measure anything (give more rows, or "
                        "--fidelity-held-out COUNT)")
    order = list(range(n))
    random.Random(f"fidelity/{opts.seed}").shuffle(order)
    held = set(order[:k])
    return [lines[i] for i in range(n) if i not in held], [lines[i] for i in range(n) if i in held]


class Search:
    """The state of one search, kept in ``OUTPUT/fidelity/search.json`` so a rerun resumes."""

    def __init__(self, cfg: FinetuneConfig, opts: FidelityOptions, *, train: Train = finetune,
                 answer: Answer | None = None) -> None:
        if cfg.kind is not ModuleKind.LORA:
            raise BadOption("--fidelity searches the layer split, which the engine serves for lora modules; "
                            "train --kind lora")
        if not cfg.cache_conditioned or cfg.recompute:
            raise BadOption("--fidelity trains the comparator (--standard) and picks --recompute itself; "
                            "leave both out")
        self.cfg, self.opts, self.train = cfg, opts, train
        self.answer = answer or _engine_answer(cfg)
        self.out = Path(cfg.output)
        self.work = self.out / WORK_DIR
        self.state_file = self.work / "search.json"

    def _state(self) -> dict[str, Any]:
        return json.loads(self.state_file.read_text()) if self.state_file.is_file() else {}

    def _save(self, state: dict[str, Any]) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.state_file)

    def run(self) -> FidelityResult:
        from transformers import AutoTokenizer

        from server.models.patch import resolve_model_dir

        t0 = time.perf_counter()
        base = resolve_model_dir(self.cfg.base)
        layers = _layers(base)
        tokenizer = AutoTokenizer.from_pretrained(base)
        source = str(self.cfg.data)
        data = Path(self.cfg.data)
        if not data.is_file():
            raise DataError(f"{data}: no such data file")
        lines = [ln for ln in data.read_text(encoding="utf-8").splitlines() if ln.strip()]
        train_lines, held_lines = split_rows(lines, self.opts, source)
        self.work.mkdir(parents=True, exist_ok=True)
        train_file, held_file = self.work / "train.jsonl", self.work / "held-out.jsonl"
        train_file.write_text("\n".join(train_lines) + "\n", encoding="utf-8")
        held_file.write_text("\n".join(held_lines) + "\n", encoding="utf-8")
        rows = [json.loads(ln) for ln in held_lines]
        examples = [parse_row(r, line=i + 1, source=str(held_file)) for i, r in enumerate(rows)]
        max_new = min(256, max(len(tokenizer.encode(r["response"], add_special_tokens=False)) for r in rows) + 8)
        state = self._state()
        key = {"config": _resume_key(self.cfg), "options": dataclasses.asdict(self.opts), "rows": len(lines)}
        if state and state.get("key") != key:
            raise DataError(f"{self.work} holds a search of another run (other data or settings); remove it "
                            "or train into another output directory")
        state.setdefault("key", key)
        state.setdefault("probes", {})
        stages = 2 + max(1, (layers - 1).bit_length()) + 1
        bar = tqdm(total=stages, desc=f"fidelity search {self.cfg.name}", disable=not self.cfg.progress)

        own_dir = self.work / "own"
        if "own" not in state:
            bar.set_postfix_str("comparator: own prefill")
            self.train(dataclasses.replace(self.cfg, data=train_file, output=own_dir, cache_conditioned=False))
            predicted = self.answer(base, {"own": own_dir}, examples, max_new)["own"]
            exact = score_rows(predicted, rows, "exact", tokenizer)
            metric = "exact" if sum(exact) / len(exact) >= EXACT_FLOOR else "tokens"
            scores = exact if metric == "exact" else score_rows(predicted, rows, "tokens", tokenizer)
            state.update(own={"scores": scores, "answers": predicted}, metric=metric)
            self._save(state)
        bar.update()
        metric, own_scores = state["metric"], state["own"]["scores"]
        own = sum(own_scores) / len(own_scores)

        def probe(k: int) -> Probe:
            if str(k) not in state["probes"]:
                bar.set_postfix_str(f"probe k = {k}")
                t = time.perf_counter()
                d = self.work / f"k{k}"
                self.train(dataclasses.replace(self.cfg, data=train_file, output=d, recompute=k))
                predicted = self.answer(base, {"probe": d}, examples, max_new)["probe"]
                scores = score_rows(predicted, rows, metric, tokenizer)
                state["probes"][str(k)] = {"scores": scores, "seconds": time.perf_counter() - t}
                self._save(state)
            bar.update()
            p = state["probes"][str(k)]
            return Probe(k, sum(p["scores"]) / len(p["scores"]), p["scores"], p["seconds"])

        k = smallest_split(lambda k: within(probe(k).gap(own), points=self.opts.points), layers, self.opts.step)
        bar.set_postfix_str(f"verify k = {k}")
        result = self._finish(k, layers, base, examples, rows, tokenizer, max_new, metric, own_scores, state, t0)
        bar.update(bar.total - bar.n)
        bar.close()
        return result

    def _finish(self, k: int, layers: int, base: Path, examples: list[Any], rows: list[dict[str, Any]],
                tokenizer: Any, max_new: int, metric: str, own_scores: list[float], state: dict[str, Any],
                t0: float) -> FidelityResult:
        chosen = self.work / ("own" if k == layers else f"k{k}")
        if state.get("chosen") != k:  # a rerun of a finished search finds the module in place
            for f in chosen.iterdir():  # the module itself: its weights and training record
                if f.is_file():
                    shutil.copy2(f, self.out / f.name)
            state["chosen"] = k
            self._save(state)
        family = _family(base, self.cfg)
        training = json.loads((self.out / "training.json").read_text())
        lora = LoraSpec(self.cfg.rank, self.cfg.alpha, tuple(self.cfg.target_modules))
        Manifest(name=self.cfg.name, kind=ModuleKind.LORA, family=family, invocation=self.cfg.placement,
                 lora=lora, training=training, recompute_layers=k).write(self.out)
        predicted = self.answer(base, {"own": self.work / "own", "chosen": self.out}, examples, max_new)
        shared_scores = score_rows(predicted["chosen"], rows, metric, tokenizer)
        ci = paired_bootstrap(shared_scores, own_scores)
        probes = [Probe(int(kk), sum(p["scores"]) / len(p["scores"]), p["scores"], p["seconds"])
                  for kk, p in state["probes"].items()]
        result = FidelityResult(self.out, k, layers, metric, sum(own_scores) / len(own_scores),
                                sum(shared_scores) / len(shared_scores), (ci["lo"], ci["hi"]),
                                self.opts.points, {"train": state["key"]["rows"] - len(examples), "held_out": len(examples)},
                                probes, time.perf_counter() - t0)
        Manifest(name=self.cfg.name, kind=ModuleKind.LORA, family=family, invocation=self.cfg.placement,
                 lora=lora, training=training, recompute_layers=k, fidelity=result.record()).write(self.out)
        for d in self.work.glob("k*"):  # the probes' weights; their scores stay in search.json
            if d.is_dir():
                shutil.rmtree(d)
        return result


def finetune_with_fidelity(cfg: FinetuneConfig, opts: FidelityOptions) -> FidelityResult:
    """Train ``cfg``'s module with the smallest layer split whose held-out accuracy is within
    ``opts.points`` of the same module on its own prefill; write it with the figures.

    >>> import json, pathlib
    >>> rows = [{"context": f"Item {i} costs {i} euros.", "instruction": f"Price of item {i}?",
    ...          "response": str(i)} for i in range(48)]
    >>> _ = pathlib.Path("rows.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
    >>> result = finetune_with_fidelity(FinetuneConfig(base=model_dir, data="rows.jsonl", output="m", name="m",
    ...                                                rank=4, alpha=8, progress=False),
    ...                                 FidelityOptions(points=100.0, held_out=24))
    >>> record = Manifest.read("m").fidelity
    >>> result.k, record["recompute_layers"], record["rows"]["held_out"], record["metric"] in ("exact", "tokens")
    (0, 0, 24, True)
    """
    return Search(cfg, opts).run()


def _engine_answer(cfg: FinetuneConfig) -> Answer:
    def answer(base: Path, modules: dict[str, Path], examples: list[Any], max_new: int) -> dict[str, list[str]]:
        return engine_answers(base, modules, examples, dtype=cfg.kv_dtype, max_new_tokens=max_new,
                              threads=cfg.threads, include_base=False, progress=cfg.progress)

    return answer


def _layers(base: Path) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(base).num_hidden_layers)


def _family(base: Path, cfg: FinetuneConfig) -> str:
    from server.kv.family import family_digest

    return family_digest(base, kv_dtype=cfg.kv_dtype)
