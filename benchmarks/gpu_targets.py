"""The state's leaf sizes and the one-line verdict of ``benchmarks/gpu.py`` (pure: no JAX, no IO).

Targets (issue 43: one H200, 8 GiB state, checkpoints on tmpfs, against the same run's peers):
save >= 12 GB/s and >= 2x the best peer; restore >= 10 GB/s and >= 1.8x the best peer; SYNC
save blocked <= 50 ms; LOW <= 5 ms; training step median within 5 % and max <= 1.5x beside a
save; host RSS growth <= budget + 64 MiB; the first save within 20 % of a later one.
"""

from __future__ import annotations

MiB = 1 << 20
SIZES = tuple(MiB << (2 * k) for k in range(6))   # 1, 4, 16, 64, 256, 1024 MiB
PEERS = ("orbax", "orbax_raw", "jax_serialization")


def leaf_sizes(total: int) -> list[int]:
    """Leaf sizes in bytes, from 1 MiB up to 1 GiB, that add up to about ``total`` bytes: one of
    each size that fits (smallest first), then the rest in the largest size that fits, so a state
    has whole-shard leaves (under a save batch) and leaves a batch splits."""
    sizes, left = [], total
    for size in SIZES:
        if size <= left:
            sizes.append(size)
            left -= size
    fitting = [s for s in SIZES if s <= max(left, 0)]
    while fitting:
        sizes.append(fitting[-1])
        left -= fitting[-1]
        fitting = [s for s in SIZES if s <= left]
    return sizes or [max(1, total)]


def _rate(runs: list, key: str, nbytes_key: str = "bytes") -> float | None:
    ok = [r for r in runs if "error" not in r and r.get(key)]
    return max(r[nbytes_key] / 1e9 / r[key] for r in ok) if ok else None


def verdict(runs: dict, step: dict, budget: int) -> tuple[str, dict]:
    """(one line, {target: (value, passed)}) for dispatch_io's runs (``runs[name]``: each child's
    dict, as gpu.py's ``child_system`` returns it) and ``step`` (``child_step``'s). A target
    that could not be measured (no peer run, no step) is left out and named as such."""
    ours = runs.get("dispatch_io", [])
    checks: dict = {}
    save, restore = _rate(ours, "save2_s"), _rate(ours, "restore_s")
    peers_save = [v for v in (_rate(runs.get(p, []), "save2_s") for p in PEERS) if v]
    peers_restore = [v for v in (_rate(runs.get(p, []), "restore_s") for p in PEERS) if v]
    if save is not None:
        checks["save >= 12 GB/s"] = (save, save >= 12)
        if peers_save:
            checks["save >= 2x best peer"] = (save / max(peers_save), save >= 2 * max(peers_save))
    if restore is not None:
        checks["restore >= 10 GB/s"] = (restore, restore >= 10)
        if peers_restore:
            checks["restore >= 1.8x best peer"] = (restore / max(peers_restore), restore >= 1.8 * max(peers_restore))
    ok = [r for r in ours if "error" not in r]
    if ok:
        sync = max(r.get("sync_blocked_s", 0) for r in ok)
        low = max(r["async_blocked_s"] for r in ok)
        first = max(r["save1_s"] / r["save2_s"] for r in ok)
        rss = max(r["save_rss"] for r in ok)
        checks["SYNC blocked <= 50 ms"] = (1e3 * sync, sync <= 0.050)
        checks["LOW blocked <= 5 ms"] = (1e3 * low, low <= 0.005)
        checks["first save <= 1.2x second"] = (first, first <= 1.2)
        checks["save RSS growth <= budget + 64 MiB (MiB)"] = (rss / MiB, rss <= budget + 64 * MiB)
        checks["bit-exact"] = (all(r["bit_exact"] for r in ok), all(r["bit_exact"] for r in ok))
    beside, alone = step.get("dispatch_io"), step.get("alone")
    if isinstance(beside, dict) and isinstance(alone, dict) and "median_ms" in beside and "median_ms" in alone:
        med = beside["median_ms"] / alone["median_ms"]
        worst = beside["max_ms"] / alone["median_ms"]
        checks["step median beside LOW save <= 1.05x"] = (med, med <= 1.05)
        checks["step max beside LOW save <= 1.5x"] = (worst, worst <= 1.5)
    if not checks:
        return "verdict: nothing measured", checks
    failed = [name for name, (_, passed) in checks.items() if not passed]
    shown = ", ".join(f"{name}: {_fmt(v)}{'' if p else ' MISSED'}" for name, (v, p) in checks.items())
    head = "verdict: every target met" if not failed else f"verdict: {len(failed)} of {len(checks)} targets missed"
    return f"{head} -- {shown}", checks


def _fmt(value) -> str:
    return str(value) if isinstance(value, bool) else f"{value:.2f}"
