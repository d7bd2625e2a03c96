"""The benchmarks' shared harness: child processes, timing, memory from the OS, results.

Every benchmark script measures in fresh child processes (so a peak RSS belongs to one
measurement), interleaves what it compares inside each repetition (this kind of shared machine
drifts: alternating reps keeps a drift from favouring one side) and reports medians with their
range. The trees measured are :mod:`tree` (``benchmarks/tree.py``); this module is the rest:

* memory: :func:`status_bytes` (``VmRSS`` / ``VmHWM`` of this process, from ``/proc``),
  :func:`reset_peak_rss` (``VmHWM`` back to the current RSS), :func:`rchar` (bytes read);
* storage: :func:`drop_caches` (cold reads; needs root), :func:`disk_usage`,
  :func:`remove_checkpoint`;
* processes: :func:`run_child` (a child that prints one ``RESULT <json>`` line, :func:`emit`;
  killed with its group after a timeout), :func:`free_port` (a ``jax.distributed`` coordinator);
* timing: :func:`interleaved` (the order of the compared things, rotated per repetition),
  :func:`median_range` ("median [min-max]");
* results: :func:`markdown` tables, :func:`code_version`, :func:`command_line`,
  :func:`write_results` (one JSON and one Markdown file per run).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MiB = 1 << 20
GiB = 1 << 30


# ---- memory, from the OS --------------------------------------------------------------------------

def status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def reset_peak_rss():
    """Reset this process's ``VmHWM`` to its current RSS (``clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def rchar() -> int:
    """Bytes this process has read through read(2) and its kin (``/proc/self/io``)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


# ---- storage ----------------------------------------------------------------------------------------

def drop_caches() -> bool:
    """sync, then drop the page cache; False when the kernel refuses (not root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def disk_usage(path) -> tuple[int, int]:
    """(bytes, files) under ``path``."""
    size = files = 0
    for root, _, names in os.walk(path):
        for name in names:
            size += os.lstat(os.path.join(root, name)).st_size
            files += 1
    return size, files


def remove(path):
    """Remove a file or a folder, if there."""
    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):
        os.remove(path)


def remove_checkpoint(path):
    """``path`` and the temporary siblings a killed save may leave: ``path.*`` (Orbax, a warm-up)
    and ``.name.*`` (dispatch_io)."""
    folder, name = map(glob.escape, os.path.split(path))
    for other in [path] + glob.glob(os.path.join(folder, name + ".*")) + glob.glob(os.path.join(folder, f".{name}.*")):
        remove(other)


# ---- processes --------------------------------------------------------------------------------------

def emit(**result):
    """A child's result: one ``RESULT <json>`` line on stdout, read by :func:`run_child` or
    :func:`results_of`."""
    print("RESULT " + json.dumps(result), flush=True)


def results_of(line: str) -> dict | None:
    """The result a :func:`emit` line carries, or None for any other line."""
    return json.loads(line[len("RESULT "):]) if line.startswith("RESULT ") else None


def run_child(cmd: list[str], timeout: float, label: str, env: dict | None = None) -> dict:
    """Run ``cmd`` in a new session and return its last :func:`emit` result (plus
    ``process_seconds``); killed with its whole group after ``timeout`` seconds. A failure or a
    timeout is a result too (``error``, and ``timeout`` True), printed with ``label``."""
    started = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env=env)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        print(f"  TIMEOUT {label}: killed after {timeout:g} s", flush=True)
        return {"error": f"timeout after {timeout:g} s", "timeout": True}
    results = [r for r in map(results_of, stdout.splitlines()) if r is not None]
    if p.returncode or not results:
        tail = stderr.strip().splitlines()[-15:]
        print(f"  FAILED {label} (rc={p.returncode}):\n    " + "\n    ".join(tail), flush=True)
        return {"error": "\n".join(tail)}
    return {**results[-1], "process_seconds": time.perf_counter() - started}


def free_port() -> int:
    """A free TCP port on loopback (a ``jax.distributed`` coordinator's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- timing -----------------------------------------------------------------------------------------

def interleaved(reps: int, names, rotate: bool = True):
    """(rep, name) for every repetition and each of ``names``, in turn inside a repetition; the
    order rotates by one per repetition with ``rotate`` (no name always first after an idle)."""
    names = list(names)
    for rep in range(reps):
        shift = rep % len(names) if rotate and names else 0
        for name in names[shift:] + names[:shift]:
            yield rep, name


def median_range(values, fmt: str = "{:.2f}") -> str:
    """'median [min-max]' of the values that are not None ('-' if none; the value if one)."""
    v = [x for x in values if x is not None]
    if not v:
        return "-"
    if len(v) == 1:
        return fmt.format(v[0])
    return f"{fmt.format(statistics.median(v))} [{fmt.format(min(v))}-{fmt.format(max(v))}]"


# ---- results ----------------------------------------------------------------------------------------

def markdown(head, rows) -> str:
    """A Markdown table of ``head`` and ``rows`` (lists of cells)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def code_version() -> str:
    """git HEAD of this repository and a digest of the library's sources as they are now (they
    may be uncommitted): a run is flagged when they change while it runs."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    sources = hashlib.sha256()
    for folder in ("dispatch_io", "workers"):
        for path in sorted(glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True)):
            with open(path, "rb") as f:
                sources.update(os.path.relpath(path, ROOT).encode() + f.read())
    return f"{head.stdout.strip() or '?'}, sources {sources.hexdigest()[:10]}"


def command_line() -> str:
    """The command as typed, relative to this directory where it can be, with PYTHONPATH if set."""
    env = f"PYTHONPATH={shlex.quote(os.environ['PYTHONPATH'])} " if os.environ.get("PYTHONPATH") else ""
    python = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable
    return env + shlex.join([python] + sys.argv)


def write_results(out: str, name: str, payload: dict, report: str) -> str:
    """Write ``payload`` (with the command line) as ``<out>/<name>-<time>.json`` and ``report`` as
    the ``.md`` beside it; return the path without its suffix."""
    os.makedirs(out, exist_ok=True)
    base = os.path.join(out, f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    with open(base + ".json", "w") as f:
        json.dump({"command": command_line(), **payload}, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(report)
    print(f"wrote {base}.json and {base}.md")
    return base
