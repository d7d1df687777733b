"""Run examples as notebook cells run: top-level ``await``, ``async with`` and ``async for``.

Jupyter compiles a cell with ``ast.PyCF_ALLOW_TOP_LEVEL_AWAIT``; code so compiled evaluates to a
coroutine when it awaits, which the notebook runs on its one event loop. The same here, for the
doctests of ``agentshare/`` and ``server/`` (:func:`top_level_await`, one loop per docstring) and
for the Python blocks of the docs (:class:`CellEvaluator`, one loop per document)::

    >>> import asyncio
    >>> await asyncio.sleep(0, "awaited at top level")
    'awaited at top level'
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import contextlib
import doctest
import inspect
from collections.abc import Iterator
from typing import Any

from sybil import Example

TOP_LEVEL_AWAIT = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
LOOP = "__event_loop__"  # where a document's namespace keeps its event loop (an asyncio.Runner)


def run_cell(code: Any, namespace: dict[str, Any], loop: asyncio.Runner) -> Any:
    """Evaluate compiled ``code`` in ``namespace``; if it awaited at top level, run it on ``loop``."""
    result = eval(code, namespace)  # the code is the repository's own examples
    return loop.run(result) if inspect.iscoroutine(result) else result


@contextlib.contextmanager
def top_level_await(loop: asyncio.Runner) -> Iterator[None]:
    """While active, :mod:`doctest` compiles examples as notebook cells and runs them on ``loop``.

    doctest calls ``compile(source, filename, "single", flags, True)`` then ``exec(code, globs)``
    on each example; both names are looked up in its module's globals before the builtins, so
    defining them there for the duration changes nothing else.
    """

    def compile_cell(source: Any, filename: str, mode: str, flags: int = 0, dont_inherit: bool = False) -> Any:
        return builtins.compile(source, filename, mode, flags | TOP_LEVEL_AWAIT, dont_inherit)

    def exec_cell(code: Any, globs: dict[str, Any] | None = None, *rest: Any) -> None:
        if isinstance(code, str) or globs is None or rest:  # doctest's debugger paths: leave them be
            builtins.exec(code, globs, *rest)
        else:
            run_cell(code, globs, loop)

    module = vars(doctest)
    assert "compile" not in module and "exec" not in module, "doctest already patched"
    module.update(compile=compile_cell, exec=exec_cell)
    try:
        yield
    finally:
        del module["compile"], module["exec"]


def doctest_names(test: doctest.DocTest) -> set[str]:
    """The names a doctest reads without binding them itself (what its namespace must provide)."""
    loaded: set[str] = set()
    bound: set[str] = set()
    for example in test.examples:
        for node in ast.walk(ast.parse(example.source)):
            if isinstance(node, ast.Name):
                (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
    return loaded - bound


class CellEvaluator:
    """A sybil evaluator: a Python block runs as a notebook cell, on its document's event loop."""

    def __call__(self, example: Example) -> None:
        __tracebackhide__ = True
        source = "\n" * (example.line + example.parsed.line_offset) + example.parsed
        code = compile(source, example.path, "exec", flags=TOP_LEVEL_AWAIT, dont_inherit=True)
        run_cell(code, example.namespace, example.namespace[LOOP])
        example.namespace.pop("__builtins__", None)  # eval adds it
