"""The thread budget of an engine process follows the option, then OMP_NUM_THREADS, then the
machine's physical cores; the server logs what it chose."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from server.engine import numerics
from server.engine.numerics import choose_threads, physical_cores


def test_the_option_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert (choose_threads(3).threads, choose_threads(3).source) == (3, "option")
    with pytest.raises(ValueError, match="positive"):
        choose_threads(0)


def test_the_environment_wins_over_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert (choose_threads(None).threads, choose_threads(None).source) == (5, "OMP_NUM_THREADS")


def test_without_either_the_physical_cores_are_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(numerics, "physical_cores", lambda cpus=None: 7)
    assert (choose_threads(None).threads, choose_threads(None).source) == (7, "physical cores")
    monkeypatch.setenv("OMP_NUM_THREADS", "not-a-number")  # ignored, not an error
    assert choose_threads(None).threads == 7


def test_hyper_threads_count_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Four logical CPUs, two per core: two physical cores."""
    siblings = {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}
    real = Path.read_text

    def read_text(self: Path, *args: object, **kwargs: object) -> str:
        parts = self.parts
        if "topology" in parts and parts[-1] == "thread_siblings_list":
            return siblings[int(parts[-3].removeprefix("cpu"))] + "\n"
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "read_text", read_text)
    assert physical_cores({0, 1, 2, 3}) == 2
    assert physical_cores({0, 2}) == 1


def test_the_cpus_bf16_instructions_and_model_are_read_from_cpuinfo() -> None:
    """AMX first (a host with AMX has AVX512-BF16 too), then AVX512-BF16; AMX tiles without
    AMX-BF16 are not bf16; a flag's name must match whole."""
    amx = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C\nflags\t\t: avx512f avx512_bf16 amx_bf16 amx_tile\n"
    epyc = "processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: avx512f avx512_bf16\n"
    assert (numerics.cpu_bf16(amx), numerics.cpu_model(amx)) == ("amx", "Intel(R) Xeon(R) Platinum 8481C")
    assert (numerics.cpu_bf16(epyc), numerics.cpu_model(epyc)) == ("avx512_bf16", "AMD EPYC 9R14")
    assert numerics.cpu_bf16("flags : avx512f amx_tile amx_int8") == "none"
    assert numerics.cpu_bf16("flags : avx512_bf16x amx_bf16x") == "none"
    assert numerics.cpu_bf16("") == "none"
    assert numerics.cpu_model("flags : avx2\nmodel name\t: \n") == numerics.platform.machine()  # empty: not a name
    assert numerics.cpu_model("model name : Vendor CPU @ 2.0GHz: rev 2\n") == "Vendor CPU @ 2.0GHz: rev 2"  # value keeps its colons


def test_without_a_text_this_machines_cpuinfo_is_read() -> None:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    assert (numerics.cpu_bf16(), numerics.cpu_model()) == (numerics.cpu_bf16(text), numerics.cpu_model(text))


def test_auto_is_bf16_where_it_is_native(monkeypatch: pytest.MonkeyPatch) -> None:
    for native, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(numerics, "cpu_has_native_bf16", lambda native=native: native)
        assert numerics.resolve_dtype("auto") == numerics.resolve_dtype("auto", "cpu") == want
        assert numerics.resolve_dtype("auto", "cuda") == torch.bfloat16  # whatever the CPU; no device needed
    assert numerics.resolve_dtype("bf16") == torch.bfloat16 and numerics.resolve_dtype("fp32", "cuda") == torch.float32
    assert numerics.resolve_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        numerics.resolve_dtype("int8")
    assert numerics.dtype_name(torch.bfloat16) == "bfloat16"


def test_the_cores_counted_are_those_this_process_may_run_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The affinity mask of this process (pid 0); without one, every CPU; a CPU whose topology
    cannot be read counts as a core of its own."""
    asked: list[int] = []
    monkeypatch.setattr(numerics.os, "sched_getaffinity", lambda pid: asked.append(pid) or {5, 6, 7})
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (_ for _ in ()).throw(OSError("no topology")))
    assert numerics.physical_cores() == 3 and asked == [0]
    monkeypatch.delattr(numerics.os, "sched_getaffinity")
    monkeypatch.setattr(numerics.os, "cpu_count", lambda: 4)
    assert numerics.physical_cores() == 4
    monkeypatch.setattr(numerics.os, "cpu_count", lambda: None)
    assert numerics.physical_cores() == 1


def test_edges_of_the_thread_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(numerics, "physical_cores", lambda cpus=None: 7)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert choose_threads(1) == numerics.ThreadChoice(1, "option", 7)  # one thread is a budget
    assert choose_threads(None) == numerics.ThreadChoice(3, "OMP_NUM_THREADS", 7)
    # a launcher asks about the environment of a process it is about to start
    assert choose_threads(None, env={"OMP_NUM_THREADS": "1"}) == numerics.ThreadChoice(1, "OMP_NUM_THREADS", 7)
    assert choose_threads(None, env={"OMP_NUM_THREADS": "0"}) == numerics.ThreadChoice(7, "physical cores", 7)
    assert choose_threads(None, env={}) == numerics.ThreadChoice(7, "physical cores", 7)


def test_set_threads_gives_torch_the_chosen_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    try:
        assert numerics.set_threads(1) == torch.get_num_threads() == 1
        assert numerics.set_threads(None) == torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
