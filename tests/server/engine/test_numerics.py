"""The thread budget of an engine process follows the option, then OMP_NUM_THREADS, then the
machine's physical cores; the server logs what it chose."""

from __future__ import annotations

from pathlib import Path

import pytest

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
