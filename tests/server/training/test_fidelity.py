"""finetune --fidelity: the search over the layer split, its record, resume and refusals.

Training and answering are injected (a module's accuracy is a function of its split k), so these
tests check the search itself; the docstring of ``finetune_with_fidelity`` runs it for real on the
tiny model through the engine.
"""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from server.cli import app
from server.modules.manifest import Manifest, ModuleKind
from server.training import fidelity as fid
from server.training.dataset import DataError, write_jsonl
from server.training.fidelity import FidelityOptions, Probe, Search, score_rows, split_rows, within
from server.training.trainer import BadOption, FinetuneConfig

LAYERS = 30
ROWS = [{"context": f"Item {i} costs {i} euros.", "instruction": f"Price of item {i}?", "response": str(i)}
        for i in range(100)]


@pytest.fixture
def data(tmp_path):
    return write_jsonl(ROWS, tmp_path / "rows.jsonl")


@pytest.fixture(autouse=True)
def thirty_layers(monkeypatch):
    monkeypatch.setattr(fid, "_layers", lambda base: LAYERS)
    monkeypatch.setattr(fid, "_family", lambda base, cfg: "ab" * 32)


class Fake:
    """A trainer and an answerer: a module of split k answers the first ``accuracy(k)`` share of
    the held-out rows right; the comparator (own prefill) answers ``own`` of them."""

    def __init__(self, accuracy, own=1.0):
        self.accuracy, self.own = accuracy, own
        self.trained: list[int | str] = []

    def train(self, cfg):
        out = Path(cfg.output)
        out.mkdir(parents=True, exist_ok=True)
        (out / "adapter_model.safetensors").write_bytes(b"weights")
        (out / "training.json").write_text(json.dumps({"recompute": cfg.recompute,
                                                       "cache_conditioned": cfg.cache_conditioned}))
        self.trained.append(cfg.recompute if cfg.cache_conditioned else "own")

    def _k(self, d: Path) -> int | None:
        if d.name == "own":
            return None
        man = Manifest.read(d)
        if man is not None:
            return man.recompute_layers
        return int(d.name.removeprefix("k"))

    def answer(self, base, modules, examples, max_new):
        out = {}
        for name, d in modules.items():
            k = self._k(Path(d))
            share = self.own if k is None or k == LAYERS else self.accuracy(k)
            right = round(share * len(examples))
            out[name] = [ex.response if i < right else "wrong" for i, ex in enumerate(examples)]
        return out


def config(tiny_model_dir, data, out, **kw):
    return FinetuneConfig(base=tiny_model_dir, data=data, output=out, name="m", rank=4, alpha=8,
                          progress=False, **kw)


def test_full_sharing_within_the_points_stops_at_k0(tiny_model_dir, data, tmp_path):
    fake = Fake(lambda k: 0.96)
    res = Search(config(tiny_model_dir, data, tmp_path / "m"), FidelityOptions(points=5, held_out=25),
                 train=fake.train, answer=fake.answer).run()
    assert (res.k, fake.trained) == (0, ["own", 0])
    assert res.gap == pytest.approx(4.0)
    man = Manifest.read(tmp_path / "m")
    assert man.recompute_layers == 0 and man.fidelity["gap_points"] == 4.0
    assert man.fidelity["rows"] == {"train": 75, "held_out": 25}
    assert not list((tmp_path / "m" / "fidelity").glob("k*"))  # probes' weights removed, scores kept


def test_the_search_finds_the_smallest_split_within_the_points(tiny_model_dir, data, tmp_path):
    # the gap closes linearly: 40 points at k = 0, two fewer per layer; within 2 points from k = 19
    fake = Fake(lambda k: min(1.0, 0.6 + k / 50))
    res = Search(config(tiny_model_dir, data, tmp_path / "m"), FidelityOptions(points=2, held_out=50),
                 train=fake.train, answer=fake.answer).run()
    passing = [k for k in range(LAYERS + 1) if 100 * (1.0 - min(1.0, 0.6 + k / 50)) <= 2 + 1e-9]
    assert res.k == min(passing) == 19
    assert len(fake.trained) <= 2 + 5  # the comparator, k = 0, and a bisection of 30 layers
    probed = {p.k: p for p in res.probes}
    assert res.k in probed and res.k - 1 in probed  # the choice and the layer below it were measured
    assert not within(probed[res.k - 1].gap(res.own), points=2)
    man = Manifest.read(tmp_path / "m")
    assert man.kind is ModuleKind.LORA and man.recompute_layers == 19
    assert man.fidelity["recompute_layers"] == 19 and man.fidelity["points"] == 2
    assert "<- chosen" in res.table() and "k = 19 of 30" in res.table()
    assert res.resolution > 2 and "measure the gap to about" in res.table()  # 50 rows cannot resolve 2 points


def test_a_coarser_step_probes_fewer_splits(tiny_model_dir, data, tmp_path):
    fake = Fake(lambda k: min(1.0, 0.6 + k / 50))
    res = Search(config(tiny_model_dir, data, tmp_path / "m"), FidelityOptions(points=3, held_out=50, step=4),
                 train=fake.train, answer=fake.answer).run()
    assert 19 <= res.k < 19 + 4
    assert len(fake.trained) <= 2 + 3


def test_when_no_split_is_within_the_points_the_module_recomputes_every_layer(tiny_model_dir, data, tmp_path):
    fake = Fake(lambda k: 0.5)
    res = Search(config(tiny_model_dir, data, tmp_path / "m"), FidelityOptions(points=1, held_out=50),
                 train=fake.train, answer=fake.answer).run()
    assert res.k == LAYERS and res.gap == 0 and res.prefill_saved == 0
    assert "<- chosen: no split was within the points" in res.table()
    man = Manifest.read(tmp_path / "m")
    assert man.recompute_layers == LAYERS
    assert json.loads((tmp_path / "m" / "training.json").read_text())["cache_conditioned"] is False  # the comparator


def test_a_rerun_resumes_the_search_without_training_again(tiny_model_dir, data, tmp_path):
    fake = Fake(lambda k: min(1.0, 0.6 + k / 50))
    cfg = config(tiny_model_dir, data, tmp_path / "m")
    opts = FidelityOptions(points=3, held_out=50)
    first = Search(cfg, opts, train=fake.train, answer=fake.answer).run()

    def never(_cfg):
        raise AssertionError("trained again")

    again = Search(cfg, opts, train=never, answer=fake.answer).run()
    assert (again.k, again.gap) == (first.k, first.gap)
    with pytest.raises(DataError, match="holds a search of another run"):
        Search(cfg, FidelityOptions(points=1, held_out=50), train=never, answer=fake.answer).run()


def test_long_free_form_answers_are_scored_by_token_agreement(tiny_model_dir, data, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [{"response": "the cat sat on the mat"}, {"response": "a b c d"}]
    assert score_rows(["the cat sat on a rug", "a b c d"], rows, "tokens", tok)[1] == 1.0
    assert 0 < score_rows(["the cat sat on a rug", "x"], rows, "tokens", tok)[0] < 1
    assert score_rows(['{"a": 1}'], [{"response": '{ "a":1 }', "task": "tool"}], "exact", tok) == [1.0]
    fake = Fake(lambda k: 0.1, own=0.1)  # the comparator is below the exact-match floor
    res = Search(config(tiny_model_dir, data, tmp_path / "m"), FidelityOptions(points=3, held_out=50),
                 train=fake.train, answer=fake.answer).run()
    assert res.metric == "tokens"


def test_split_rows_is_seeded_and_refuses_too_few_rows(data):
    lines = data.read_text().splitlines()
    train, held = split_rows(lines, FidelityOptions(points=1, held_out=0.2), "rows.jsonl")
    assert (len(train), len(held)) == (80, 20) and sorted(train + held) == sorted(lines)
    assert split_rows(lines, FidelityOptions(points=1, held_out=0.2), "x") == (train, held)
    with pytest.raises(DataError, match="needs at least 20 of each"):
        split_rows(lines[:30], FidelityOptions(points=1, held_out=0.2), "rows.jsonl")
    with pytest.raises(DataError, match=r"rows\.jsonl:2: missing field 'response'"):
        split_rows([lines[0], '{"context": "c", "instruction": "q"}'] + lines[2:], FidelityOptions(points=1), "rows.jsonl")


def test_refusals(tiny_model_dir, data, tmp_path):
    with pytest.raises(BadOption, match="lora modules"):
        Search(config(tiny_model_dir, data, tmp_path / "m", kind=ModuleKind.FULL), FidelityOptions(points=1))
    with pytest.raises(BadOption, match="leave both out"):
        Search(config(tiny_model_dir, data, tmp_path / "m", recompute=3), FidelityOptions(points=1))
    with pytest.raises(BadOption, match="percentage points"):
        FidelityOptions(points=-1)
    with pytest.raises(BadOption, match="at least one layer"):
        FidelityOptions(points=1, step=0)
    assert Probe(0, 0.5, [1.0, 0.0], 1.0).gap(0.75) == 25.0


def test_the_cli_refuses_a_fidelity_search_it_cannot_run(tiny_model_dir, data, tmp_path):
    r = CliRunner().invoke(app, ["finetune", str(data), "-o", str(tmp_path / "m"), "--name", "m",
                                 "--base", str(tiny_model_dir), "--fidelity", "1", "--kind", "full"])
    assert r.exit_code == 2
    assert "--fidelity searches the layer split" in r.output
    r = CliRunner().invoke(app, ["finetune", str(data), "-o", str(tmp_path / "m"), "--name", "m",
                                 "--base", str(tiny_model_dir), "--fidelity", "1", "--fidelity-held-out", "5"])
    assert r.exit_code == 2 and "needs at least 20 of each" in r.output


def test_the_cli_runs_the_search_with_its_options_and_prints_the_table(tiny_model_dir, data, tmp_path, monkeypatch):
    seen = {}

    def search(cfg, opts):
        seen.update(cfg=cfg, opts=opts)
        return fid.FidelityResult(tmp_path / "m", 8, 30, "exact", 0.9, 0.89, (-0.03, 0.01), 2.0,
                                  {"train": 70, "held_out": 30}, [Probe(0, 0.7, [], 1.0), Probe(8, 0.89, [], 1.0)], 5.0)

    monkeypatch.setattr(fid, "finetune_with_fidelity", search)
    r = CliRunner().invoke(app, ["finetune", str(data), "-o", str(tmp_path / "m"), "--name", "m", "--base",
                                 str(tiny_model_dir), "--fidelity", "2", "--fidelity-held-out", "30",
                                 "--fidelity-step", "4", "--seed", "3"])
    assert r.exit_code == 0, r.output
    assert seen["opts"] == FidelityOptions(points=2.0, held_out=30, step=4, seed=3)
    assert seen["cfg"].cache_conditioned and seen["cfg"].recompute == 0
    assert "chosen k = 8 of 30" in r.output and "<- chosen" in r.output and "recompute_layers 8" in r.output
    r = CliRunner().invoke(app, ["finetune", str(data), "-o", str(tmp_path / "m"), "--name", "m", "--base",
                                 str(tiny_model_dir), "--fidelity", "2", "--fidelity-held-out", "0.25"])
    assert seen["opts"].held_out == 0.25
