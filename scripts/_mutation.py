"""Driver of scripts/mutation: mutmut 3 over the rule modules, then the hand-made mutants.

Each module runs in its own directory ``.mutation/<module>/`` (links to the tree, plus a
pyproject.toml whose ``[tool.mutmut]`` is the project's with the module and its tests added),
so each keeps its own mutmut cache: a rerun tests only the functions whose code changed.
A mutant that no test reaches counts as a survivor. Survivors listed in
``tests/mutants/equivalent.toml`` (name = reason) are equivalent and leave the score.

Each ``tests/mutants/*.patch`` names its tests on ``Tests:`` lines before the diff; the patch
is applied in a temporary copy of the tree (the live tree is never touched), and each line's
tests must pass on the copy and fail once it is patched.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".mutation"
MUTANTS = ROOT / "tests" / "mutants"
TARGET = 0.90  # killed share of the non-equivalent mutants, per module


@dataclass(frozen=True)
class Module:
    source: str
    tests: tuple[str, ...]  # pytest arguments: its fast tests only (no server, no cluster)


MODULES: dict[str, Module] = {
    "prompt": Module("server/prompt.py", ("tests/server/test_prompt.py",)),
    "keys": Module("server/kv/keys.py", ("tests/server/kv/test_keys.py",)),
    "pool": Module("server/kv/pool.py",
                   ("tests/server/kv/test_pool.py", "tests/server/kv/test_pool_properties.py")),
    "tenancy": Module("server/api/tenancy.py",
                      ("tests/server/api/test_tenancy.py", "-k", "not served")),
    "sampling": Module("server/engine/sampling.py", ("tests/server/engine/test_sampling.py",)),
    "protocol": Module("agentshare/protocol.py", ("tests/sdk/test_protocol.py",)),
    "codec": Module("server/cluster/codec.py", ("tests/server/cluster/test_codec.py",)),
}
LINKED = ("agentshare", "server", "tests")
SURVIVED = {"survived", "no tests"}
KILLED = {"killed", "timeout", "caught by type check"}


@dataclass
class Tally:
    module: str
    mutants: int = 0
    killed: int = 0
    timeout: int = 0
    suspicious: int = 0
    survivors: list[str] = field(default_factory=list)  # not equivalent
    equivalent: list[str] = field(default_factory=list)
    seconds: float = 0.0
    tried: int = 0  # mutants run this time (the rest came from the cache)

    @property
    def score(self) -> float:
        relevant = self.mutants - len(self.equivalent)
        return 1.0 if relevant == 0 else (self.killed + self.timeout) / relevant


def module_config(module: Module) -> str:
    """The project's pyproject.toml with this module's [tool.mutmut] (pytest reads the rest)."""
    text = (ROOT / "pyproject.toml").read_text()
    table = tomllib.loads(text)["tool"]["mutmut"]
    table = {**table, "only_mutate": [module.source],
             "pytest_add_cli_args_test_selection": [module.source, *module.tests]}
    text = re.sub(r"(?ms)^\[tool\.mutmut\]\n.*?(?=^\[|\Z)", "", text)
    # JSON scalars and lists of strings are valid TOML values.
    lines = [f"{key} = {json.dumps(value)}" for key, value in table.items()]
    return text.rstrip() + "\n\n[tool.mutmut]\n" + "\n".join(lines) + "\n"


def prepare(name: str) -> Path:
    work = WORK / name
    work.mkdir(parents=True, exist_ok=True)
    for entry in LINKED:
        link = work / entry
        if not link.is_symlink():
            link.symlink_to(ROOT / entry, target_is_directory=True)
    config = module_config(MODULES[name])
    target = work / "pyproject.toml"
    if not target.exists() or target.read_text() != config:
        target.write_text(config)
    return work


def mutmut(work: Path, *args: str) -> int:
    """Run mutmut in ``work``; its progress goes to ``work/mutmut.log``, the tail is shown on failure."""
    exe = Path(sys.executable).with_name("mutmut")
    log = work / "mutmut.log"
    with log.open("w") as out:
        rc = subprocess.call([str(exe), *args], cwd=work, stdout=out, stderr=subprocess.STDOUT)
    if rc != 0:
        print(re.sub(r"[^\n]*\r", "", log.read_text())[-4000:])
    return rc


def tally(name: str, work: Path, equivalent: dict[str, str]) -> Tally:
    from mutmut.stats import status_by_exit_code

    meta = json.loads((work / "mutants" / (MODULES[name].source + ".meta")).read_text())
    t = Tally(name)
    for key, code in meta["exit_code_by_key"].items():
        status = status_by_exit_code[code]
        t.mutants += 1
        if status == "killed" or status == "caught by type check":
            t.killed += 1
        elif status == "timeout":
            t.timeout += 1
        elif status in SURVIVED:
            (t.equivalent if key in equivalent else t.survivors).append(key)
        else:  # suspicious, segfault, not checked, interrupted
            t.suspicious += 1
            t.survivors.append(key)
    return t


def run_module(name: str, workers: int, equivalent: dict[str, str]) -> Tally:
    work = prepare(name)
    print(f"== {name}: {MODULES[name].source} against {' '.join(MODULES[name].tests)}", flush=True)
    before = _checked(work, name)
    start = time.monotonic()
    rc = mutmut(work, "run", "--max-children", str(workers))
    seconds = time.monotonic() - start
    if rc != 0:
        raise SystemExit(f"mutmut run failed for {name} (exit {rc}); see the output above")
    t = tally(name, work, equivalent)
    t.seconds = seconds
    t.tried = t.mutants - before
    for key in t.survivors:
        print(f"   survivor: {key}  (mutmut show {key}, in {work})")
    return t


def _checked(work: Path, name: str) -> int:
    """Mutants whose result is cached (mutmut keeps them unless their function changed)."""
    path = work / "mutants" / (MODULES[name].source + ".meta")
    if not path.exists():
        return 0
    return sum(code is not None for code in json.loads(path.read_text())["exit_code_by_key"].values())


def print_table(tallies: list[Tally], equivalent: dict[str, str]) -> None:
    print("\n| module | mutants | killed | timeout | survivors | equivalent | score | tried | minutes | mutants/min |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for t in tallies:
        rate = t.tried / (t.seconds / 60) if t.seconds and t.tried else 0.0
        print(f"| {t.module} | {t.mutants} | {t.killed} | {t.timeout} | {len(t.survivors)} "
              f"| {len(t.equivalent)} | {t.score:.1%} | {t.tried} | {t.seconds / 60:.1f} | {rate:.1f} |")
    for t in tallies:
        for key in t.equivalent:
            print(f"   equivalent {key}: {equivalent[key]}")


# ---- hand-made mutants ---------------------------------------------------------------------


def copy_tree(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file() and not src.is_symlink():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def pytest_in(tree: Path, tests: list[str]) -> int:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
           "-o", "addopts=--strict-markers", *tests]
    return subprocess.call(cmd, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def check_patch(patch: Path) -> list[str]:
    """Problems of one hand-made mutant (empty: each of its test lines kills it)."""
    groups = [line.split(":", 1)[1].split() for line in patch.read_text().splitlines()
              if line.startswith("Tests:")]
    if not groups:
        return [f"{patch.name}: no 'Tests:' line names the tests that must kill it"]
    problems = []
    with tempfile.TemporaryDirectory(prefix="agentshare-mutant-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        where = subprocess.run([sys.executable, "-c", "import server; print(server.__file__)"], cwd=tree,
                               check=True, capture_output=True, text=True).stdout.strip()
        if not Path(where).is_relative_to(tree):
            return [f"{patch.name}: the copy imports {where}, not its own tree"]
        for tests in groups:
            if pytest_in(tree, tests) != 0:
                problems.append(f"{patch.name}: {' '.join(tests)} fail(s) without the patch")
        applied = subprocess.run(["git", "apply", str(patch)], cwd=tree, capture_output=True, text=True)
        if applied.returncode != 0:
            return [f"{patch.name}: does not apply to the current code: {applied.stderr.strip()}"]
        for tests in groups:
            rc = pytest_in(tree, tests)
            verdict = "killed" if rc == 1 else "SURVIVED" if rc == 0 else f"error (pytest exit {rc})"
            print(f"   {patch.name}: {' '.join(tests)}: {verdict}", flush=True)
            if rc != 1:
                problems.append(f"{patch.name}: {' '.join(tests)}: {verdict}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(prog="scripts/mutation", description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", metavar="MODULE", help=f"default: all of {', '.join(MODULES)}")
    parser.add_argument("--workers", type=int, default=int(os.environ.get("MUTATION_WORKERS", "2")),
                        help="mutmut --max-children (at most 2)")
    parser.add_argument("--no-patches", action="store_true", help="skip the hand-made mutants")
    parser.add_argument("--patches-only", action="store_true", help="only the hand-made mutants")
    args = parser.parse_args()
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        parser.error(f"unknown module(s) {', '.join(unknown)}; choose from {', '.join(MODULES)}")
    if not 1 <= args.workers <= 2:
        parser.error("--workers must be 1 or 2")
    # TERM (e.g. a CI timeout) unwinds like Ctrl-C, so temporary trees are removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    equivalent = tomllib.loads((MUTANTS / "equivalent.toml").read_text())
    failures: list[str] = []
    tallies: list[Tally] = []
    if not args.patches_only:
        start = time.monotonic()
        for name in args.modules or list(MODULES):
            t = run_module(name, args.workers, equivalent)
            tallies.append(t)
            if t.score < TARGET:
                failures.append(f"{name}: {t.score:.1%} of the non-equivalent mutants killed "
                                f"(target {TARGET:.0%}); survivors above")
        print_table(tallies, equivalent)
        print(f"total {(time.monotonic() - start) / 60:.1f} min")
        known = {key for t in tallies for key in t.equivalent}
        for key in equivalent:
            if any(key.startswith(MODULES[t.module].source[:-3].replace("/", ".") + ".") for t in tallies) \
                    and key not in known:
                print(f"   note: equivalent.toml lists {key}, which no longer survives or exists")
    if not args.no_patches:
        print("== hand-made mutants (tests/mutants/*.patch)", flush=True)
        for patch in sorted(MUTANTS.glob("*.patch")):
            failures += check_patch(patch)
    for line in failures:
        print(f"FAILED {line}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
