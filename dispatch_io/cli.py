"""``dispatch-io``: look inside a checkpoint and check it, from a shell.

    dispatch-io inspect PATH [--json]   key path, shape, dtype, saved sharding, bytes; totals
    dispatch-io verify PATH [--budget-mib N]
                                        read every stored byte (and check the CRC-32Cs, if saved),
                                        holding at most N MiB (default 256) of it at once
                                        (or two stored chunks, where those are larger)
    dispatch-io convert SRC DST [--budget-mib N] [--layout ocdbt|files] [--overwrite]
                       [--to dispatch_io|safetensors|orbax] [--max-shard-size 5GB] [--skip-unsupported]
                                        copy SRC (dispatch_io, Orbax or safetensors) into a new
                                        checkpoint at DST (outside SRC) in the format --to, N MiB
                                        at a time; --overwrite replaces a checkpoint at DST
    dispatch-io bench [ARGS...]         run benchmarks/compare.py (a source checkout) with ARGS

Each reads every format (Orbax checkpoints and safetensors too) only through the library, work on a machine with a single CPU device, and
answer a bad path, an uncommitted save, a foreign directory or a malformed checkpoint (a damaged
or crafted description) with one line and exit status 2 (``verify``: 1 when the stored data is
unsound), never a traceback; ``--verbose`` adds the chained causes in full.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

import humanize

EXIT_UNSOUND = 1
EXIT_UNUSABLE = 2


def _sharding_text(sharding: dict | None) -> str:
    if not sharding:
        return "-"
    if sharding.get("type") == "NamedSharding":
        mesh = "mesh(" + ", ".join(f"{name}={size}" for name, size in sharding["mesh"].items()) + ")"
        spec = ", ".join("None" if p is None else "+".join(p) if isinstance(p, list) else str(p)
                         for p in sharding["spec"])
        return f"P({spec}) on {mesh}"
    if sharding.get("type") == "SingleDeviceSharding":
        return f"device {sharding['device']}"
    return sharding.get("type", "?")


def _rows(manifest) -> list[dict]:
    """One row per leaf of a manifest: what ``inspect`` shows."""
    from dispatch_io.incremental import references
    from dispatch_io import tree as tree_lib
    from dispatch_io.workers import numpy_dtype

    rows = []
    for leaf in manifest.leaves:
        if leaf.kind == tree_lib.SCALAR:
            rows.append({"keypath": leaf.keypath, "kind": "scalar", "shape": [], "dtype": leaf.origin,
                         "sharding": None, "bytes": 0, "value": tree_lib.encode_scalar(leaf.value)})
            continue
        stored = leaf.stored
        nbytes = 0 if stored is None else math.prod(stored.shape) * numpy_dtype(stored.dtype).itemsize
        dtype = str(leaf.dtype) + (f" ({leaf.key_impl})" if leaf.key_impl else "")
        rows.append({"keypath": leaf.keypath, "kind": leaf.kind, "shape": list(leaf.shape), "dtype": dtype,
                     "sharding": leaf.described_sharding, "bytes": nbytes,
                     "pack": None if stored is None or stored.packed is None else stored.packed[0].name,
                     # an incremental step's chunks other steps store: {step: bytes}
                     "referenced": {} if stored is None else references.referenced(stored)})
    return rows


def _open(path: str):
    """The checkpoint at ``path``, opened (either format); one this version cannot read fails here."""
    from dispatch_io.formats.detect import open_checkpoint

    return open_checkpoint(path)


def _manager_steps(path: str) -> list[tuple[int, str]] | None:
    """``[(step, its path)]`` if ``path`` is a CheckpointManager root (holding committed steps,
    not itself a checkpoint), else None."""
    import os

    from dispatch_io.formats.detect import committed_steps, orbax_item, step_path
    from dispatch_io.storage import Location, StepRoot

    location = Location.parse(path)
    local = path.removeprefix("file://")
    if ("://" not in local and not os.path.isdir(local)) or location.is_committed() or orbax_item(path):
        return None  # (opening a directory root would create it)
    root = StepRoot.open(path)
    return [(step, step_path(root, step)) for step in committed_steps(root)] or None


def inspect_root(steps: list[tuple[int, str]], as_json: bool) -> int:
    """A CheckpointManager root: each committed step's info (times, metrics, items, processes)."""
    import datetime
    import dataclasses

    from dispatch_io.manager.root_steps import read_info

    infos = [read_info(path, step) for step, path in steps]
    if as_json:
        print(json.dumps([{k: v for k, v in dataclasses.asdict(i).items() if k not in ("arrays", "item_entries")}
                          for i in infos], indent=1))
        return 0
    when = lambda t: "-" if t is None else datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S")
    table = [("step", "committed (UTC)", "seconds", "metrics", "items", "processes")]
    for i in infos:
        took = "-" if i.started is None or i.committed is None else f"{i.committed - i.started:.1f}"
        metrics = " ".join(f"{k}={v:g}" if v is not None else f"{k}=nan" for k, v in i.metrics.items()) or "-"
        items = " ".join(f"{k}({v})" for k, v in i.items.items()) or "-"
        table.append((str(i.step), when(i.committed), took, metrics, items, str(i.processes or "-")))
    widths = [max(len(row[c]) for row in table) for c in range(len(table[0]))]
    for r, row in enumerate(table):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if r == 0:
            print("  ".join("-" * w for w in widths))
    print(f"\n{len(infos)} committed steps")
    return 0


def inspect(path: str, as_json: bool) -> int:
    steps = _manager_steps(path)
    if steps:
        return inspect_root(steps, as_json)
    manifest = _open(path).manifest
    rows = _rows(manifest)
    total = sum(r["bytes"] for r in rows)
    if as_json:
        compression = None if manifest.compression is None else dict(zip(("codec", "level"), manifest.compression))
        print(json.dumps({"path": path, "format": manifest.format, "layout": manifest.layout,
                          "compression": compression, "leaves": rows, "total_bytes": total,
                          "checksums": manifest.has_checksums}, indent=1))
        return 0
    table = [("key path", "shape", "dtype", "saved sharding", "bytes")]
    for r in rows:
        shape = "(" + ", ".join(map(str, r["shape"])) + ("," if len(r["shape"]) == 1 else "") + ")"
        table.append((r["keypath"], shape if r["kind"] != "scalar" else "scalar", r["dtype"],
                      _sharding_text(r["sharding"]), humanize.naturalsize(r["bytes"], binary=True)))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for i, row in enumerate(table):
        print("  ".join(cell.ljust(w) if c < 4 else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    arrays = sum(r["kind"] != "scalar" for r in rows)
    written_by = "" if manifest.format == "dispatch_io" else f", written by {manifest.format.capitalize()}"
    compressed = "" if manifest.compression is None else ", compression {} level {}".format(*manifest.compression)
    packs = {r["pack"] for r in rows if r.get("pack")}
    count = sum(bool(r.get("pack")) for r in rows)
    packed = f", {count} of them packed into {len(packs)} stored array{'s' * (len(packs) != 1)}" if packs else ""
    by_step: dict[str, int] = {}
    for r in rows:
        for step, n in r.get("referenced", {}).items():
            by_step[step] = by_step.get(step, 0) + n
    elsewhere = "" if not by_step else "\nincremental: {} here, {} referenced ({})".format(
        humanize.naturalsize(total - sum(by_step.values()), binary=True),
        humanize.naturalsize(sum(by_step.values()), binary=True),
        ", ".join(f"{humanize.naturalsize(n, binary=True)} in step {s}" for s, n in sorted(by_step.items(), key=lambda x: int(x[0]))))
    print(f"\n{len(rows)} leaves ({arrays} arrays{packed}), {humanize.naturalsize(total, binary=True)} stored "
          f"({total} bytes), layout {manifest.layout}{compressed}{written_by}{elsewhere}")
    return 0


def convert(src: str, dst: str, budget_mib: int = 256, layout: str = "ocdbt", overwrite: bool = False,
            to: str = "dispatch_io", max_shard_size: int | None = None, skip_unsupported: bool = False) -> int:
    """``Dispatcher.convert``: ``src`` (dispatch_io, Orbax or safetensors) into a new checkpoint at
    ``dst`` in the format ``to`` (``overwrite``: replacing one there), holding at most the budget
    of it in memory."""
    import dispatch_io as dio
    from dispatch_io.formats import exporting
    from dispatch_io.formats.convert import check_apart
    from dispatch_io.storage import DirectoryLocation, Location
    from dispatch_io.storage.folders import Folder

    destination = Location.parse(dst)
    check_apart(Location.parse(src), destination)
    _open(src)  # an unusable source is exit status 2, before anything is written
    # the library's messages name its keywords, not our flags
    if not overwrite and to == "dispatch_io" and destination.is_committed():
        raise FileExistsError(f"a checkpoint is already committed at {dst}; pass --overwrite to replace it")
    if not overwrite and to != "dispatch_io" and (os.path.lexists(dst) if isinstance(destination, DirectoryLocation)
                                                  else Folder.open(dst).exists()):
        raise FileExistsError(f"{dst} exists; pass --overwrite to replace it")
    with dio.LocalDispatcher(host_memory_budget=budget_mib << 20, layout=layout) as dispatcher:
        try:
            stats = dispatcher.convert(src, dst, overwrite=overwrite, to=to, max_shard_size=max_shard_size,
                                       skip_unsupported=skip_unsupported)
        except exporting.Unsupported as exc:  # the same refusal, naming our flag
            raise exporting.Unsupported(exc.keypath, exc.reason, "--skip-unsupported") from None
    seconds = stats.total_seconds
    if to == "dispatch_io":
        print(f"{dst}: {humanize.naturalsize(stats.bytes_written, binary=True)} converted from {src} "
              f"in {seconds:.1f} s (layout {layout})")
        return 0
    skipped = f"; skipped {len(stats.skipped)}: {', '.join(stats.skipped)}" if stats.skipped else ""
    print(f"{dst}: {humanize.naturalsize(stats.bytes_written, binary=True)} exported from {src} to {to} "
          f"in {seconds:.1f} s{skipped}")
    return 0


_SIZE = re.compile(r"([0-9]+)\s*(|B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def _size(text: str) -> int:
    """A byte count written as Hugging Face writes shard sizes: ``5GB``, ``500MB``, ``2GiB``, ``1000``."""
    match = _SIZE.fullmatch(text.strip())
    if not match or int(match[1]) == 0:
        raise argparse.ArgumentTypeError(f"expected a size such as 5GB, 500MB or 2GiB, got {text!r}")
    return int(match[1]) * _UNITS[match[2].lower()]


def verify(path: str, budget_mib: int = 256, verbose: bool = False) -> int:
    """``Dispatcher.verify`` (a manager step's item files included): chunk by chunk, so memory stays within the budget whatever the
    checkpoint's size (progress on stderr when it is a terminal); ``verbose``: with the causes."""
    import dispatch_io as dio
    from dispatch_io.storage import sealed

    try:
        _open(path)  # an unusable path is exit status 2, before reading
    except dio.CorruptCheckpointError as exc:
        if not sealed.broken(exc):
            raise
        return _unsound(path, exc, verbose)   # its manifest changed after it was written: corrupt, not foreign
    with dio.LocalDispatcher(host_memory_budget=budget_mib << 20) as dispatcher:
        try:
            stats = dispatcher.verify(path)
        except (dio.CorruptCheckpointError, dio.WorkerError, dio.CheckpointError) as exc:
            return _unsound(path, exc, verbose)
    what = "every stored byte read and its CRC-32C checked" if stats.verified else \
        "every stored byte read (saved without checksums: Options(checksums=True) adds them)"
    print(f"{path}: sound ({what}{f'; {stats.items_checked} item files checked' if stats.items_checked else ''})")
    return 0


def _unsound(path: str, exc: BaseException, verbose: bool) -> int:
    print(f"dispatch-io verify: {path} is NOT sound: {exc}{_causes(exc) if verbose else ''}", file=sys.stderr)
    return EXIT_UNSOUND


def bench(args: list[str]) -> int:
    """Run the CPU comparison benchmark of a source checkout (benchmarks/ is not installed with the package)."""
    import os
    import subprocess

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "compare.py")
    if not os.path.isfile(script):
        print(f"dispatch-io bench: no {script}: the benchmark ships with the source checkout, not the package",
              file=sys.stderr)
        return EXIT_UNUSABLE
    return subprocess.call([sys.executable, script, *args])


def _causes(exc: BaseException) -> str:
    """The exceptions chained under ``exc``, in full (TensorStore's own messages included), one
    line each: what ``--verbose`` adds to the one-line error."""
    lines, cause = [], exc.__cause__ or exc.__context__
    while cause is not None and len(lines) < 8:
        lines.append(f"\n  caused by {type(cause).__name__}: {cause}")
        cause = cause.__cause__ or cause.__context__
    return "".join(lines)


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _versions() -> str:
    """This package's version and those of the stack it runs on (what a bug report needs)."""
    import importlib.metadata

    from dispatch_io import __version__
    stack = ", ".join(f"{name} {importlib.metadata.version(name)}" for name in ("jax", "jaxlib", "tensorstore", "numpy"))
    return f"dispatch-io {__version__} (Python {sys.version.split()[0]}, {stack})"


class _Version(argparse.Action):
    """``--version``: prints :func:`_versions` as one line and exits (argparse's own version
    action wraps its text to the terminal's width)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show the version of dispatch-io and of its stack, and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(_versions())
        parser.exit()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dispatch-io", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action=_Version)
    commands = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--verbose", action="store_true", help="on an error, also print its causes in full")
    p = commands.add_parser("inspect", help="list the leaves of a checkpoint", parents=[common])
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = commands.add_parser("verify", help="read every byte of a checkpoint and check its checksums",
                            parents=[common])
    p.add_argument("path")
    p.add_argument("--budget-mib", type=_positive_int, default=256,
                   help="host memory the reads may hold at once, in MiB (default 256)")
    p = commands.add_parser("convert", help="copy a checkpoint (dispatch_io, Orbax, safetensors) into a new one",
                            parents=[common])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--budget-mib", type=_positive_int, default=256,
                   help="host memory the copy may hold at once, in MiB (default 256)")
    p.add_argument("--layout", choices=("ocdbt", "files"), default="ocdbt", help="chunk layout of DST")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint committed at DST")
    p.add_argument("--to", choices=("dispatch_io", "safetensors", "orbax"), default="dispatch_io",
                   help="format of DST (default dispatch_io); safetensors and orbax write a local path or an "
                        "s3:// / gs:// prefix")
    p.add_argument("--max-shard-size", type=_size, default=None,
                   help="--to safetensors: tensor bytes per file, e.g. 5GB (the default)")
    p.add_argument("--skip-unsupported", action="store_true",
                   help="--to safetensors: leave out what it cannot hold (PRNG keys, Python scalars, int4...)")
    p = commands.add_parser("bench", help="run benchmarks/compare.py (dispatch_io against Orbax and JAX); --help there lists its options",
                            add_help=False)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # everything after it is the benchmark's, --help included
        return bench(argv[1:])
    args = parser.parse_args(argv)
    from dispatch_io.errors import CheckpointError

    paths = (args.src, args.dst) if args.command == "convert" else (args.path,)
    if "" in paths:
        print(f"dispatch-io {args.command}: a checkpoint path must not be empty", file=sys.stderr)
        return EXIT_UNUSABLE
    try:
        if args.command == "inspect":
            return inspect(args.path, args.json)
        if args.command == "convert":
            return convert(args.src, args.dst, args.budget_mib, args.layout, args.overwrite, args.to,
                           args.max_shard_size, args.skip_unsupported)
        return verify(args.path, args.budget_mib, args.verbose)
    except (CheckpointError, OSError, ValueError) as exc:  # what an unusable path raises; a bug still tracebacks
        path = args.src if args.command == "convert" else args.path
        print(f"dispatch-io {args.command}: {exc}{_steps_hint(path)}{_causes(exc) if args.verbose else ''}",
              file=sys.stderr)
        return EXIT_UNUSABLE


def _steps_hint(path: str) -> str:
    """For a CheckpointManager root given where a checkpoint was expected: which steps it holds."""
    import os

    from dispatch_io.errors import CheckpointError
    from dispatch_io.formats.detect import committed_steps, step_path
    from dispatch_io.storage import StepRoot

    try:
        if "://" not in path.removeprefix("file://") and not os.path.isdir(path.removeprefix("file://")):
            return ""  # (opening a directory root would create it)
        root = StepRoot.open(path)
        steps = committed_steps(root)
        latest = step_path(root, steps[-1]) if steps else None
    except (CheckpointError, OSError, ValueError):  # only a hint; the error above stands
        return ""
    if not steps:
        return ""
    shown = ", ".join(map(str, steps[-5:]))
    return (f" (it is a CheckpointManager root with committed steps {'..., ' if len(steps) > 5 else ''}{shown}: "
            f"try {latest})")


if __name__ == "__main__":
    sys.exit(main())
