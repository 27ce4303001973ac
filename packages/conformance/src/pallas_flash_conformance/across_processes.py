"""One process of a job that checks a backend over a mesh spanning several processes.

    python -m pallas_flash_conformance.across_processes --backend NAME --check decode \\
        --coordinator localhost:PORT --num-processes 2 --process-id I

Each process joins the job (``jax.distributed``, gloo collectives on CPU), builds the same
inputs as NumPy arrays, calls the backend over a mesh of every process's devices
(``jax.make_mesh``, as users build one), gathers the output and compares it with the float64
reference; it exits 0 when it matches. `run_job` starts the processes and waits for them
(`test_across_processes`); `coordinator_address` gives any such job on localhost its
coordinator's address.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import random
import socket
import subprocess
import sys
from collections.abc import Sequence

CHECKS = ("decode", "context_parallel")
TIMEOUT_S = 600
EPHEMERAL_PORTS = pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range")
"""Linux's range of ports it hands to sockets that bind port 0 or connect unbound."""


def coordinator_address() -> str:
    """``localhost:PORT`` for the coordinator of a job started on this machine, ``PORT`` free
    now and below the kernel's ephemeral range.

    A port the kernel handed out (bind to port 0, then close) can be handed to another socket
    (a gloo connection, a test's client) before the coordinator binds it; a port below that
    range is only ever taken by a process that names it. The port is drawn at random, so that
    jobs started at once by parallel test processes do not pick the same one.
    """
    try:
        low = int(EPHEMERAL_PORTS.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    draw = random.Random()  # seeded from the OS: parallel processes draw apart
    for _ in range(100):
        port = draw.randrange(max(1024, low - 12288), low)
        with socket.socket() as s:
            try:
                s.bind(("localhost", port))
            except OSError:
                continue  # taken: draw again
        return f"localhost:{port}"
    raise RuntimeError(f"no free port below {low} for a coordinator after 100 draws")


def _decode(backend: str) -> None:
    """Split-KV decoding of a ragged GQA batch, the cache's sequence split over the mesh."""
    import jax
    import numpy as np

    import pallas_flash as pf
    from pallas_flash.mesh_placement import to_host
    from pallas_flash_conformance import inputs, reference
    from pallas_flash_conformance.parity import FORWARD_TOLERANCE, assert_close

    batch, q_heads, kv_heads, max_len, head_dim = 3, 8, 2, 512, 64
    q = np.asarray(inputs.normal(0, (batch, q_heads, head_dim), "float32"))
    k_cache = np.asarray(inputs.normal(1, (batch, kv_heads, max_len, head_dim), "float32"))
    v_cache = np.asarray(inputs.normal(2, (batch, kv_heads, max_len, head_dim), "float32"))
    lengths = np.asarray([512, 0, 300], np.int32)
    mesh = jax.make_mesh((jax.device_count(),), ("kv",))
    out = pf.decode(q, k_cache, v_cache, lengths, backend=backend, mesh=mesh)
    expected = reference.decode(q, k_cache, v_cache, lengths, sm_scale=1 / math.sqrt(head_dim))
    assert_close(to_host(out), expected, FORWARD_TOLERANCE["float32"])


def _context_parallel(backend: str) -> None:
    """Causal zigzag attention with segment ids, the sequence split over the mesh."""
    import jax
    import numpy as np

    import pallas_flash as pf
    from pallas_flash.mesh_placement import to_host
    from pallas_flash_conformance import reference
    from pallas_flash_conformance.calls import Case
    from pallas_flash_conformance.parity import FORWARD_TOLERANCE, assert_close

    devices = jax.device_count()
    seq = 64 * 2 * devices
    case = Case(kv_len=seq, q_len=seq, batch=1, q_heads=4, kv_heads=2, head_dim=64,
                causal=True, segments=3)  # fmt: skip
    q, k, v = (np.asarray(x) for x in case.arrays())
    ids = [np.asarray(x) for x in case.segment_ids()]
    mesh = jax.make_mesh((devices,), ("seq",))
    zig = [pf.to_zigzag(x, devices) for x in (q, k, v)]
    zig_ids = pf.SegmentIds(*(pf.to_zigzag(x, devices, 1) for x in ids))
    out = pf.attention(*zig, causal=True, segment_ids=zig_ids, mesh=mesh,
                       context_layout="zigzag", backend=backend)  # fmt: skip
    expected = reference.attention(q, k, v, **case.reference_kwargs())
    got = pf.from_zigzag(to_host(out), devices)
    assert_close(got, expected, FORWARD_TOLERANCE["float32"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", required=True)
    parser.add_argument("--check", choices=CHECKS, required=True)
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    args = parser.parse_args(argv)

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    {"decode": _decode, "context_parallel": _context_parallel}[args.check](args.backend)
    return 0


def run_job(backend: str, check: str, processes: int = 2, devices_each: int = 2) -> None:
    """Runs the check as ``processes`` processes of ``devices_each`` CPU devices each on
    localhost.

    Raises:
      AssertionError: a process failed; its standard error is in the message.
    """
    env = {k: v for k, v in os.environ.items() if k != "PALLAS_FLASH_DETECT_RACES"}
    env |= {
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_each}",
    }
    job = ["--coordinator", coordinator_address(), "--num-processes", str(processes)]
    command = [sys.executable, "-m", __name__, "--backend", backend, "--check", check, *job]
    output = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    ranks = range(processes)
    jobs = [subprocess.Popen([*command, "--process-id", str(r)], env=env, **output) for r in ranks]
    failures = []
    try:
        for rank, job in enumerate(jobs):
            out, _ = job.communicate(timeout=TIMEOUT_S)
            if job.returncode != 0:
                failures.append(f"process {rank} (exit {job.returncode}):\n{out[-4000:]}")
    finally:
        for job in jobs:
            job.kill()
    assert not failures, "\n".join(failures)


if __name__ == "__main__":
    sys.exit(main())
