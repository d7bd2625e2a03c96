"""The tables benchmarks/compare.py prints: per tree size, every system's rows and the limits; then
the targets, from the medians of the same run.
"""

import math
import os
import statistics
import time

import dispatch_io as dio
import tree as bt
from compare_systems import DISPATCH_IO_SYSTEMS, SAVE_MODES, SYSTEMS, DispatchIOBaseline
from harness import GiB, MiB, command_line, markdown
from harness import median_range as stat

RSS_SLACK = 64 * MiB
LIMITS = (("write_fsync", "write+fsync"), ("read_cold", "read cold"), ("device_get", "jax.device_get"))


def rss_target(r) -> int | None:
    """Bytes of peak RSS over the pre-call RSS allowed to a run of a system with a budget."""
    cls = SYSTEMS[r["system"].split("@")[0]]
    if not cls.has_budget or (r["mode"] in SAVE_MODES and not getattr(cls, "budgeted_saves", True)):
        return None
    restored = r["device_bytes"] if r["mode"].startswith("restore") else 0
    return restored + r["budget_mib"] * MiB + RSS_SLACK


def runs_cell(rs, ok) -> str:
    """'ok/all', with what went wrong with the others."""
    counts = {why: sum(bool(r.get(why)) for r in rs) for why in ("timeout", "skipped")}
    counts["FAILED"] = len(rs) - len(ok) - sum(counts.values())
    return f"{len(ok)}/{len(rs)}" + "".join(f" {why} {n}" for why, n in counts.items() if n)


def rss_cell(ok) -> str:
    """RSS target in GiB and whether the worst run meets it."""
    targets = [rss_target(r) for r in ok]
    if not ok or targets[0] is None:
        return "-"
    met = all(r["peak_over_before"] <= t for r, t in zip(ok, targets))
    return f"{max(targets) / GiB:.2f} {'yes' if met else 'NO'}"


def system_row(label, mode, rs) -> list:
    ok = [r for r in rs if "error" not in r]
    col = lambda key, scale=1.0: [r[key] / scale if r.get(key) is not None else None for r in ok]
    verified = "-" if not any("verified" in r for r in ok) else ("yes" if all(r.get("verified") for r in ok) else "NO")
    return [label, mode, runs_cell(rs, ok), stat(col("first_wall")), stat(col("wall")),
            stat([r["nbytes"] / 1e9 / r["wall"] for r in ok], "{:.3g}"), stat(col("blocked"), "{:.3f}"),
            stat(col("peak_over_before", GiB)), stat(col("steady_peak_over_before", GiB)), rss_cell(ok),
            stat(col("files"), "{:.0f}"), stat(col("disk_bytes", 1e9), "{:.3f}"), verified]


def limit_rows(limits) -> list[list]:
    ok = [r for r in limits if "error" not in r]
    read_ok = "yes" if all(r["read_ok"] for r in ok) else "NO"
    rows = []
    for key, label in LIMITS:
        for memory in ("cold", "warm"):
            ts = [r[f"{key}_{memory}"] for r in ok]
            rows.append(["limit", f"{label} ({memory} memory)", runs_cell(limits, ok), "-", stat(ts),
                         stat([r["nbytes"] / 1e9 / t for r, t in zip(ok, ts)], "{:.3g}"), "-", "-", "-", "-",
                         "1" if key != "device_get" else "-", "-", read_ok if key == "read_cold" else "-"])
    return rows


def size_table(results, size) -> str:
    head = ["system", "mode", "runs", "1st call s", "wall s", "GB/s", "blocked s", "peak RSS +GiB",
            "steady peak +GiB", "RSS target GiB, met", "files", "disk GB", "verified"]
    mine = [r for r in results if r["size"] == str(size)]
    rows = []
    for label in dict.fromkeys(r["system"] for r in mine if r["system"] != "limit"):
        for mode in dict.fromkeys(r["mode"] for r in mine if r["system"] == label):
            rows.append(system_row(label, mode, [r for r in mine if (r["system"], r["mode"]) == (label, mode)]))
    return markdown(head, rows + limit_rows([r for r in mine if r["system"] == "limit"]))


class Medians:
    """Medians over the successful runs of one benchmark, by (size, system, mode)."""

    def __init__(self, results):
        self.results = [r for r in results if "error" not in r]

    def get(self, size, system, mode, key):
        v = [r[key] for r in self.results
             if (r["size"], r["system"], r["mode"]) == (str(size), system, mode) and r.get(key) is not None]
        return statistics.median(v) if v else None

    def gbs(self, size, system, mode):
        wall = self.get(size, system, mode, "wall")
        return wall and self.get(size, system, mode, "nbytes") / 1e9 / wall

    def limit(self, size, key):
        """Median seconds of a cold-memory limit."""
        return self.get(size, "limit", "limits", f"{key}_cold")

    def limit_gbs(self, size, key):
        t = self.limit(size, key)
        return t and self.get(size, "limit", "limits", "nbytes") / 1e9 / t


def verdict(text, met) -> str:
    return f"{text} {'met' if met else 'NOT met'}"


def ratio_cell(value, reference, minimum, percent=False) -> str:
    if not value or not reference:
        return "-"
    ratio = value / reference
    return verdict(f"{ratio * 100:.3g}%" if percent else f"{ratio:.3g}x", ratio >= minimum)


def scaling_cell(m, size, system, mode) -> str:
    """4 GiB wall / 1 GiB wall, shown in the 4 GiB column (4096, tf4g)."""
    if size not in bt.SCALES_FROM:
        return "-"
    big, small = m.get(size, system, mode, "wall"), m.get(bt.SCALES_FROM[size], system, mode, "wall")
    return verdict(f"{big / small:.2f}x", big / small <= 4.4) if big and small else "-"


def same_bytes_cell(m, size, system) -> str:
    """A transformer-shaped tree's save GB/s over the training state's of the same size."""
    if size not in bt.SAME_BYTES:
        return "-"
    return ratio_cell(m.gbs(size, system, "save"), m.gbs(bt.SAME_BYTES[size], system, "save"), 0.9, percent=True)


def many_wall_cell(m, size, system, mode) -> str:
    wall = m.get(size, system, mode, "wall") if size == bt.MANY else None
    return "-" if wall is None else verdict(f"{wall:.2f} s", wall <= 1.5)


def async_blocked_cell(m, size, system) -> str:
    blocked = m.get(size, system, "async", "blocked")
    return "-" if blocked is None else verdict(f"{blocked * 1e3:.1f} ms", blocked <= 0.020)


def blocked_vs_device_get(m, size, system) -> str:
    blocked, device_get = m.get(size, system, "async_sync", "blocked"), m.limit(size, "device_get")
    if blocked is None or not device_get:
        return "-"
    return verdict(f"{blocked:.3f} s / {device_get:.3f} s = {blocked / device_get:.2f}x", blocked <= device_get)


def files_cell(m, size, system) -> str:
    """Files of a 1 GiB save: at most 20 besides the OCDBT data files the system asks for (one
    per ``data_file_bytes`` stored; ``dispatch_io_fewfiles``: none), so never a file per chunk."""
    files = m.get(size, system, "save", "files")
    if files is None:
        return "-"
    if size not in (1024, "tf1g") or system == DispatchIOBaseline.name:  # another checkout's options
        return f"{files:.0f}"
    options = dio.Options(**SYSTEMS[system].options)
    data_files = 0
    if options.layout == "ocdbt" and options.data_file_bytes:
        data_files = math.ceil(m.get(size, system, "save", "disk_bytes") / options.data_file_bytes)
    return verdict(f"{files:.0f} (limit {20 + data_files})", files <= 20 + data_files)


TARGETS = (
    ("save GB/s vs orbax >= 3x", lambda m, s, d: ratio_cell(m.gbs(s, d, "save"), m.gbs(s, "orbax", "save"), 3)),
    ("save GB/s vs write+fsync >= 80%",
     lambda m, s, d: ratio_cell(m.gbs(s, d, "save"), m.limit_gbs(s, "write_fsync"), 0.8, percent=True)),
    ("cold restore GB/s vs orbax >= 2.5x",
     lambda m, s, d: ratio_cell(m.gbs(s, d, "restore"), m.gbs(s, "orbax", "restore"), 2.5)),
    ("cold restore GB/s vs cold read >= 70%",
     lambda m, s, d: ratio_cell(m.gbs(s, d, "restore"), m.limit_gbs(s, "read_cold"), 0.7, percent=True)),
    ("async blocked <= 20 ms", lambda m, s, d: async_blocked_cell(m, s, d)),
    ("async_sync blocked <= device_get", lambda m, s, d: blocked_vs_device_get(m, s, d)),
    ("files <= 20 + data files at 1 GiB", lambda m, s, d: files_cell(m, s, d)),
    ("save wall 4 GiB / 1 GiB <= 4.4x", lambda m, s, d: scaling_cell(m, s, d, "save")),
    ("restore wall 4 GiB / 1 GiB <= 4.4x", lambda m, s, d: scaling_cell(m, s, d, "restore")),
    ("save GB/s vs training state of the same size >= 90%", lambda m, s, d: same_bytes_cell(m, s, d)),
    ("10k save wall <= 1.5 s", lambda m, s, d: many_wall_cell(m, s, d, "save")),
    ("10k cold restore wall <= 1.5 s", lambda m, s, d: many_wall_cell(m, s, d, "restore")),
)


def targets_table(results, sizes, systems) -> str:
    m = Medians(results)
    rows = [[name, system] + [cell(m, size, system) for size in sizes]
            for system in systems if system in DISPATCH_IO_SYSTEMS for name, cell in TARGETS]
    return markdown(["target", "system"] + [f"{s} MiB" if isinstance(s, int) else str(s) for s in sizes], rows)


def report(a, header, notes, refs, results, systems) -> str:
    parts = [f"{time.strftime('%Y-%m-%d %H:%M %Z')}, in {os.getcwd()}:\n\n    {command_line()}", header]
    parts += notes
    for size in a.sizes:
        ref = refs[size]
        parts.append(f"### {size}{' MiB' if isinstance(size, int) else ''} tree: "
                     f"{ref.get('nbytes', 0) / 1e9:.3f} GB logical\n\n{size_table(results, size)}")
    parts.append("median [min-max] over reps; GB/s = logical bytes / 1e9 / wall s; peak RSS +GiB = VmHWM over "
                 "both calls - RSS before them (baseline method); steady peak = VmHWM during the steady call - RSS "
                 "just before it; RSS target = budget + 64 MiB (+ restored bytes, every device replica, for "
                 "restores), met when the worst run's peak RSS + is within it")
    parts.append("### Targets (medians of this run; limits on cold memory)\n\n"
                 + targets_table(results, a.sizes, systems))
    return "\n\n".join(parts) + "\n"
