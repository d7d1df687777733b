"""Driver of scripts/mutation: mutmut 3 over the rule modules, then the hand-made mutants.

Each module runs in its own directory ``.mutation/<module>/`` (links to the tree, plus a
pyproject.toml whose ``[tool.mutmut]`` is the project's with the module and its tests added),
so each keeps its own mutmut cache: a rerun tests only the functions whose code changed.
A mutant that no test reaches counts as a survivor. Survivors listed in
``tests/mutants/equivalent.toml`` (function, mutated line, reason: so an entry outlives mutmut's
renumbering) are equivalent and leave the score.

Each ``tests/mutants/*.patch`` names its tests on ``Tests:`` lines before the diff. In a
temporary copy of the tree (the live tree is never touched) those tests must pass; then each
patch is applied and reverted in turn, and at least one test of each of its lines must fail.
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
    "positions": Module("server/positions.py", ("tests/server/test_positions.py", "-k", "not engine")),
    "keys": Module("server/kv/keys.py", ("tests/server/kv/test_keys.py",)),
    "pool": Module("server/kv/pool.py",
                   ("tests/server/kv/test_pool.py", "tests/server/kv/test_pool_properties.py")),
    "tenancy": Module("server/api/tenancy.py",
                      ("tests/server/api/test_tenancy.py", "-k", "authenticate or salt")),
    "sampling": Module("server/engine/sampling.py",
                       ("tests/server/engine/test_sampling.py", "tests/server/engine/test_sampling_robust.py")),
    "protocol": Module("agentshare/protocol.py", ("tests/sdk/test_protocol.py",)),
    "codec": Module("server/cluster/codec.py", ("tests/server/cluster/test_codec.py",)),
    "tools": Module("server/api/tools.py", ("tests/server/api/test_tool_format.py", "tests/server/api/test_tools.py",
                                            "tests/server/api/test_tools_template.py")),
    "int8": Module("server/cluster/codecs/int8.py", ("tests/server/cluster/test_codec.py",)),
    # which module's weights compute each row: base rows exact, each LoRA row its own deltas only
    "projection": Module("server/engine/projection.py", ("tests/server/engine/test_engine_projection.py",)),
    # where an engine computes and how much KV fits there; decode steps padded for CUDA graphs
    "device": Module("server/engine/device.py", ("tests/server/engine/test_device.py", "server/engine/device.py",
                                                 "-k", "not every_kind and not mixes_devices")),
    "graphs": Module("server/engine/graphs.py", ("tests/server/engine/test_graphs.py", "server/engine/graphs.py")),
    # the vllm engine's prefix store and its transfer between hosts (what reaches a decode instance)
    "store": Module("server/vllm/store.py", ("tests/server/vllm/test_store.py",)),
    "relay": Module("server/vllm/relay.py", ("tests/server/vllm/test_relay.py",)),
    # the compute dtype, the thread budget and the CPU's bf16 instructions of an engine process
    "numerics": Module("server/engine/numerics.py", ("tests/server/engine/test_numerics.py", "server/engine/numerics.py")),
    # which module directories share the base's prefill, get a private one, or are refused
    "registry": Module("server/modules/registry.py", ("tests/server/modules/test_registry.py",)),
}
LINKED = ("agentshare", "server", "tests", "conftest.py")
SURVIVED = {"survived", "no tests"}
KILLED = {"killed", "timeout", "caught by type check"}


@dataclass
class Tally:
    module: str
    mutants: int = 0
    killed: int = 0
    timeout: int = 0
    suspicious: int = 0
    survivors: list[tuple[str, str]] = field(default_factory=list)  # (mutant, what it does), not equivalent
    equivalent: list[tuple[str, str]] = field(default_factory=list)
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
            link.symlink_to(ROOT / entry, target_is_directory=(ROOT / entry).is_dir())
    # mutmut copies tests/ over its old copy: start from a fresh one, so that a test file
    # deleted or moved in the tree does not live on there.
    shutil.rmtree(work / "mutants" / "tests", ignore_errors=True)
    config = module_config(MODULES[name])
    target = work / "pyproject.toml"
    if not target.exists() or target.read_text() != config:
        # mutmut regenerates a module's mutants only when its source changes, and keeps results
        # by mutant number: after a change of configuration (e.g. what is not mutated), start over.
        for stale in (MODULES[name].source, MODULES[name].source + ".meta"):
            (work / "mutants" / stale).unlink(missing_ok=True)
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


def mutant_line(work: Path, key: str) -> str:
    """The mutated line of one mutant (the ``+`` side of ``mutmut show``), stripped."""
    exe = Path(sys.executable).with_name("mutmut")
    diff = subprocess.run([str(exe), "show", key], cwd=work, capture_output=True, text=True).stdout
    added = [line[1:].strip() for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    return " / ".join(added) or "(no diff)"


def function_of(key: str) -> str:
    """``server.prompt.x_chat_prompt__mutmut_9`` -> ``server.prompt.x_chat_prompt``."""
    return key.partition("__mutmut_")[0]


def is_equivalent(key: str, line: str, equivalent: list[dict[str, str]]) -> bool:
    return any(e["function"] == function_of(key) and e["mutant"] == line for e in equivalent)


def tally(name: str, work: Path, equivalent: list[dict[str, str]]) -> Tally:
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
        else:  # survived, no tests (counted as survivors), suspicious, segfault, not checked
            if status not in SURVIVED:
                t.suspicious += 1
            line = mutant_line(work, key)
            if status in SURVIVED and is_equivalent(key, line, equivalent):
                t.equivalent.append((key, line))
            else:
                t.survivors.append((key, f"{status}: {line}"))
    return t


def run_module(name: str, workers: int, equivalent: list[dict[str, str]]) -> Tally:
    work = prepare(name)
    print(f"== {name}: {MODULES[name].source} against {' '.join(MODULES[name].tests)}", flush=True)
    _retest_survivors(work, name)
    before = _checked(work, name)
    start = time.monotonic()
    rc = mutmut(work, "run", "--max-children", str(workers))
    seconds = time.monotonic() - start
    if rc != 0:
        raise SystemExit(f"mutmut run failed for {name} (exit {rc}); see the output above")
    t = tally(name, work, equivalent)
    t.seconds = seconds
    t.tried = t.mutants - before
    for key, what in t.survivors:
        print(f"   survivor {key}  {what}")
    if t.survivors:
        print(f"   (see one with: cd {work.relative_to(ROOT)} && mutmut show NAME)")
    return t


def _retest_survivors(work: Path, name: str) -> None:
    """Forget the survivors' results: mutmut keeps every result until its function changes,
    but a survivor may be killed by a test written since."""
    from mutmut.stats import status_by_exit_code

    path = work / "mutants" / (MODULES[name].source + ".meta")
    if not path.exists():
        return
    meta = json.loads(path.read_text())
    codes = meta["exit_code_by_key"]
    for key, code in codes.items():
        if code is not None and status_by_exit_code[code] not in KILLED:
            codes[key] = None
    path.write_text(json.dumps(meta, indent=4))


def _checked(work: Path, name: str) -> int:
    """Mutants whose result is cached (mutmut keeps them unless their function changed)."""
    path = work / "mutants" / (MODULES[name].source + ".meta")
    if not path.exists():
        return 0
    return sum(code is not None for code in json.loads(path.read_text())["exit_code_by_key"].values())


def print_table(tallies: list[Tally], equivalent: list[dict[str, str]]) -> None:
    print("\n| module | mutants | killed | timeout | suspicious | survivors | equivalent | score | tried | minutes | mutants/min |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for t in tallies:
        rate = t.tried / (t.seconds / 60) if t.seconds and t.tried else 0.0
        print(f"| {t.module} | {t.mutants} | {t.killed} | {t.timeout} | {t.suspicious} | {len(t.survivors)} "
              f"| {len(t.equivalent)} | {t.score:.1%} | {t.tried} | {t.seconds / 60:.1f} | {rate:.1f} |")
    reasons = {(e["function"], e["mutant"]): e["reason"] for e in equivalent}
    for t in tallies:
        for key, line in t.equivalent:
            print(f"   equivalent {key}: {line}  -- {reasons[function_of(key), line]}")


# ---- hand-made mutants ---------------------------------------------------------------------


def copy_tree(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file() and not src.is_symlink():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def pytest_in(tree: Path, tests: list[str]) -> tuple[int, set[str], str]:
    """Exit status, ids of the failed or erroring tests, and the tail of the output."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-p", "no:randomly",
           "-o", "addopts=--strict-markers", *tests]
    run = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    failed = {line.split()[1] for line in run.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))}
    return run.returncode, failed, (run.stdout + run.stderr)[-3000:]


def _in_group(test_id: str, group: list[str]) -> bool:
    return any(test_id == t or test_id.startswith((t + "::", t + "[")) for t in group)


def check_patches(patches: list[Path]) -> list[str]:
    """Problems of the hand-made mutants (empty: each test line of each one kills it).

    One temporary copy of the tree: its tests must pass as they are, then each patch is
    applied, its tests run once, and the patch is reverted (checked) before the next.
    """
    specs = []
    for patch in patches:
        groups = [line.split(":", 1)[1].split() for line in patch.read_text().splitlines()
                  if line.startswith("Tests:")]
        if not groups:
            return [f"{patch.name}: no 'Tests:' line names the tests that must kill it"]
        specs.append((patch, groups))
    everything = sorted({t for _, groups in specs for g in groups for t in g})
    with tempfile.TemporaryDirectory(prefix="agentshare-mutants-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        where = subprocess.run([sys.executable, "-c", "import server; print(server.__file__)"], cwd=tree,
                               check=True, capture_output=True, text=True).stdout.strip()
        if not Path(where).is_relative_to(tree):
            return [f"the copy of the tree imports {where}, not its own files"]
        rc, failed, tail = pytest_in(tree, everything)
        if rc != 0:
            print(tail)
            return [f"the tests of the hand-made mutants fail without them (exit {rc}): {sorted(failed)}"]
        problems = []
        for patch, groups in specs:
            applied = subprocess.run(["git", "apply", str(patch)], cwd=tree, capture_output=True, text=True)
            if applied.returncode != 0:
                problems.append(f"{patch.name}: does not apply to the current code: {applied.stderr.strip()}")
                continue
            rc, failed, tail = pytest_in(tree, sorted({t for g in groups for t in g}))
            subprocess.run(["git", "apply", "-R", str(patch)], cwd=tree, check=True, capture_output=True)
            for group in groups:
                hit = sorted(t for t in failed if _in_group(t, group))
                verdict = f"killed by {len(hit)} test(s)" if hit else "SURVIVED"
                print(f"   {patch.name}: {' '.join(group)}: {verdict}", flush=True)
                if not hit:
                    problems.append(f"{patch.name}: survives {' '.join(group)}")
            if rc not in (0, 1):
                print(tail)
                problems.append(f"{patch.name}: pytest exit {rc} (not a test failure)")
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

    equivalent = tomllib.loads((MUTANTS / "equivalent.toml").read_text()).get("equivalent", [])
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
        used = {(function_of(key), line) for t in tallies for key, line in t.equivalent}
        for e in equivalent:
            module = next((t.module for t in tallies if e["function"].startswith(
                MODULES[t.module].source[:-3].replace("/", ".") + ".")), None)
            if module and (e["function"], e["mutant"]) not in used:
                print(f"   note: equivalent.toml's {e['function']}: {e['mutant']!r} no longer survives")
    if not args.no_patches:
        print("== hand-made mutants (tests/mutants/*.patch)", flush=True)
        failures += check_patches(sorted(MUTANTS.glob("*.patch")))
    for line in failures:
        print(f"FAILED {line}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
