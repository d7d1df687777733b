"""Process-level settings of a serving process (server/process.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from agentshare.local_server import free_port as sdk_free_port
from server.process import free_port as server_free_port

_SCRIPT = """
import resource, sys, threading
import torch
from server.process import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
faults = lambda: resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
counts = []
def step():  # an engine thread's activations: allocated, written, freed, again
    for _ in range(5):
        before = faults()
        a = torch.empty(2 << 20); a.fill_(1); b = torch.empty(1 << 20); b.fill_(1)
        del a, b
        counts.append(faults() - before)
t = threading.Thread(target=step); t.start(); t.join()
print(sum(counts[1:]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keep_freed_memory_is_accepted_and_saves_page_faults_of_a_thread() -> None:
    """In fresh processes (it changes malloc for good): glibc accepts the settings, and a thread
    that allocates and frees its buffers step after step faults no more pages in than by default."""
    faults = {}
    for arm in ("default", "keep"):
        out = subprocess.run([sys.executable, "-c", _SCRIPT, arm], capture_output=True, text=True, check=True)
        faults[arm] = int(out.stdout.split()[-1])
    assert faults["keep"] <= faults["default"], faults


@pytest.mark.parametrize("pick", [server_free_port, sdk_free_port], ids=["server", "sdk"])
def test_a_free_port_is_drawn_below_the_ephemeral_range_and_binds(pick) -> None:
    """Below the kernel's ephemeral range no outgoing connection or bind to port 0 takes the port
    between its choice and its bind (a node's frontend lost its port that way while vLLM started)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {pick() for _ in range(5)}
    assert all(10000 <= p < low for p in ports) and len(ports) > 1
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
