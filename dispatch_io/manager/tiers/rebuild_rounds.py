"""A parity rebuild's rounds (``rebuild``): what one process does in them, its buffers, the rounds.

* :class:`Part`: the rounds a process is in (``parity_plan.transfers``, early and late), the chains it
  starts as a holder or sends on as a member, and the step's row groups (:class:`Rows`);
* :class:`Ready`: its buffers for one row group, made (and the rounds' programs compiled) before its
  rows are in hand;
* :func:`exchange`: one phase's rounds run, each a collective permute among the round's processes.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from dispatch_io.manager.tiers import parity_plan
from dispatch_io.multihost import scaleout
from dispatch_io.multihost.rows import Sender
from dispatch_io.workers import aligned_empty


@dataclasses.dataclass(frozen=True)
class Rows:
    """The rows of a step's row groups from index ``first`` on (a rebuild goes one row group at a
    time): one of ``W`` bytes per (row group, device position), cut into ``k`` pieces; a transfer
    carries one piece of every device position's row, in turn."""

    k: int
    groups: list
    devices: int
    first: int = 0

    def cells(self):
        """(group index, group, device position, piece width) of every row."""
        for g, group in enumerate(self.groups, self.first):
            for i in range(self.devices):
                yield g, group, i, group["W"] // self.k


def _parity_rows_in(held: dict, row: np.ndarray, width: int) -> np.ndarray:
    """``row`` (the row that travels) with a holder's parity rows written in, every device position's
    in turn (``held`` {device position: row}; zeros where it could not be read)."""
    for i in range(row.size // width):
        row[i * width:(i + 1) * width] = held.get(i, 0)
    return row


def exchange(rows: Rows, rounds: list, senders: list, me: int, held: dict, ready: "Ready") -> tuple[int, Exception | None]:
    """Run ``rounds`` (of ``parity_plan.transfers``, those this process is in) for one row group through
    their ``senders``: as a holder it starts a lost piece's chain with its parity rows ``held``
    {device position: row}, as a member it XORs its own piece (``ready.pieces``) into the sum that
    came to it (``ready.partial``) and sends it on; a lost process keeps the rows its pieces come in
    (``ready.data``, {j: piece j of every device position's row, in turn}). Returns (the bytes it
    received, the first error it met making a row it sends, if any: it sent its idle row instead and
    went on, for its partners wait in each round's collective -- the caller fails the rebuild
    everywhere once the rounds are over)."""
    width, received, error = rows.groups[0]["W"] // rows.k, 0, None
    for moves, sender in zip(rounds, senders):
        out = next((m for m in moves if m[0] == me), None)
        into = next((m for m in moves if m[1] == me), None)
        try:
            if out is None:
                row = ready.idle
            elif out[4] is None:   # a holder's parity rows, each device position's in turn
                row = _parity_rows_in(held, ready.sending[out[2:4]], width)
            else:                  # the sum so far, XORed into this member's piece (each piece is in one chain)
                row = np.bitwise_xor(ready.pieces[out[4]], ready.partial.pop(out[2:4]), out=ready.pieces[out[4]])
        except Exception as exc:  # noqa: BLE001 - reported to every process after the rounds, then raised
            error, row = error or exc, ready.idle
        got = sender(row)
        if into is None:
            continue
        received += got.size
        if into[1] == into[2]:   # this lost process's piece j of every device's row: its regions are cut from it
            ready.data[into[3]] = got
        else:
            ready.partial[into[2:4]] = got
    return received, error


def senders(rounds: list, size: int) -> list:
    """A ``multihost.rows.Sender`` of rows of ``size`` bytes for each round of ``rounds`` (of
    ``parity_plan.transfers``): each (sender, receiver, ...) of the round sends its row to its
    receiver alone, over the processes' first devices (a collective permute among the round's
    processes; the others take no part). Made before the rounds' rows are: made, each compiles its
    program, which a fresh process -- a lost one -- would otherwise do in the middle of the rounds."""
    devices, made = scaleout.carriers(jax.process_count()), []
    for moves in rounds:
        taking = tuple(sorted({p for move in moves for p in move[:2]}))
        pairs = tuple((taking.index(move[0]), taking.index(move[1])) for move in moves)
        made.append(Sender((taking,), devices, pairs, size))
    return made


def _touched(size: int) -> np.ndarray:
    """``size`` bytes of host memory, zeros, each page written once: a process makes its rebuild's
    buffers while it waits for its rows (first touches of fresh memory are slow)."""
    data = aligned_empty((size,), np.uint8)
    data.fill(0)
    return data


@dataclasses.dataclass(frozen=True)
class Ready:
    """A process's buffers for one row group's rounds, made before its rows are in hand (while it
    waits for the pass to read them): a sender per round, early and late (:func:`senders`), the
    member pieces it packs {piece: row} (each sent on with the sum that came to it XORed in, in
    place), the row it sends for each lost piece whose chain it starts as its holder {(lost, j):
    row}, the row it puts in a round in which it sends nothing (``idle``: a collective
    permute reads no row a process does not send), the sums that came to it {(lost, j): row}, and,
    if it is lost, the rows its pieces came in {j: row} (``data``, filled by :func:`exchange`; else
    None). Every buffer it writes is touched once when made, and every one is aligned: on CPU a row
    then goes into its collective without a copy (``jax.device_put`` aliases aligned host memory)."""

    early: list
    late: list
    pieces: dict
    sending: dict
    idle: np.ndarray
    data: dict | None
    partial: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, part: "Part", rows: Rows, lost: bool) -> "Ready":
        size = rows.devices * (rows.groups[0]["W"] // rows.k)
        made = senders(part.early + part.late, size)
        return cls(made[:len(part.early)], made[len(part.early):], {j: _touched(size) for j in part.pieces},
                   {key: _touched(size) for key in part.holding}, aligned_empty((size,), np.uint8),  # never read
                   {} if lost else None)


@dataclasses.dataclass(frozen=True)
class Part:
    """What one process does in a rebuild: the rounds it is in, early and late
    (``parity_plan.transfers``), the (lost, j) chains it starts as their holder, the pieces of its
    own rows it XORs in as a member, and the step's row groups (``k``, device positions per process)."""

    early: list
    late: list
    holding: set
    pieces: set
    groups: list

    @classmethod
    def of(cls, sections: dict, lost, me: int) -> "Part":
        first = sections[min(sections)]
        order, k = tuple(first["ring"]), first["k"]
        devices = len(first["layouts"][str(min(sections))][0])
        early, late = ([r for r in rounds if any(me in move[:2] for move in r)]
                       for rounds in parity_plan.transfers(order, k, lost))
        mine = [move for r in early + late for move in r if move[0] == me]
        return cls(early, late, {move[2:4] for move in mine if move[4] is None},
                   {move[4] for move in mine if move[4] is not None},
                   [Rows(k, [group], devices, g) for g, group in enumerate(first["groups"])])
