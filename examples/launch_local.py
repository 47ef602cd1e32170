"""Start N local processes of train_moe.py on 127.0.0.1: multi-host training on one machine.

Each process gets ``--coordinator 127.0.0.1:<free port> --num-processes N --process-id i
--devices-per-process D`` (D = total devices / N, 8 by default) and the arguments after ``--``.
Their output is streamed with a ``[i]`` prefix. If any process fails, or the timeout passes,
the others are killed (their whole process groups); the exit code is non-zero if any failed.

Usage::

    python examples/launch_local.py -n 2 -- --steps 20 --log-every 1
    python examples/launch_local.py -n 4 --timeout 600 -- --steps 50 --ckpt-dir /tmp/moe_mh
    python examples/launch_local.py -n 2 --script other.py -- --flag value
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from jaxops.testing import child_environ


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(i: int, proc: subprocess.Popen, sink: list[str], quiet: bool) -> None:
    for line in proc.stdout:
        sink.append(line)
        if not quiet:
            sys.stdout.write(f"[{i}] {line}")
            sys.stdout.flush()


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def launch(
    num_processes: int,
    script_args: list[str],
    *,
    script: str | os.PathLike | None = None,
    total_devices: int = 8,
    timeout: float = 600.0,
    quiet: bool = False,
) -> tuple[list[int | None], list[str]]:
    """Runs the processes; returns (exit code per process, None if killed; output per process)."""
    if num_processes < 1 or total_devices % num_processes:
        raise ValueError(f"{total_devices} devices cannot be split over {num_processes} processes")
    script = Path(script) if script else Path(__file__).with_name("train_moe.py")
    port = free_port()
    # This environment less its CPU device count (each process sets its own); XLA_FLAGS' other
    # options pass through.
    env = child_environ()
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONUNBUFFERED"] = "1"
    procs, outputs, pumps = [], [], []
    for i in range(num_processes):
        cmd = [
            sys.executable,
            str(script),
            "--coordinator",
            f"127.0.0.1:{port}",
            "--num-processes",
            str(num_processes),
            "--process-id",
            str(i),
            "--devices-per-process",
            str(total_devices // num_processes),
            *script_args,
        ]
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,  # its own process group, killed as a whole
        )
        sink: list[str] = []
        pump = threading.Thread(target=_pump, args=(i, proc, sink, quiet), daemon=True)
        pump.start()
        procs.append(proc)
        outputs.append(sink)
        pumps.append(pump)
    deadline = time.monotonic() + timeout
    codes: list[int | None] = [None] * num_processes
    try:
        while True:
            for i, p in enumerate(procs):
                codes[i] = p.poll()
            if any(c not in (None, 0) for c in codes):
                print(
                    f"launch_local: a process failed (exit codes {codes}); stopping all",
                    file=sys.stderr,
                )
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                print(f"launch_local: timeout after {timeout} s; stopping all", file=sys.stderr)
                break
            time.sleep(0.2)
    finally:
        _kill_all(procs)
        for pump in pumps:
            pump.join(timeout=5)
    return codes, ["".join(o) for o in outputs]


def main(argv: list[str] | None = None) -> int:
    """Parses the launcher's flags (those before ``--``); returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        cut = argv.index("--")
        ours, rest = argv[:cut], argv[cut + 1 :]
    else:
        ours, rest = argv, []
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--num-processes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=8, help="total CPU devices (8)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    parser.add_argument("--script", default=None, help="the script (train_moe.py)")
    parser.add_argument("--quiet", action="store_true", help="do not stream the outputs")
    args = parser.parse_args(ours)
    codes, outputs = launch(
        args.num_processes,
        rest,
        script=args.script,
        total_devices=args.devices,
        timeout=args.timeout,
        quiet=args.quiet,
    )
    ok = all(c == 0 for c in codes)
    if args.quiet and not ok:
        for i, out in enumerate(outputs):
            sys.stderr.write(f"---- process {i} (exit code {codes[i]}):\n{out[-4000:]}\n")
    print(f"launch_local: exit codes {codes}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
