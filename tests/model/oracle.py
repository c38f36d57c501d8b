"""What a user of dcpstore should see: the oracle of the model-based test (``rules.py``).

It records only what the user was told and what the documentation entitles
the library to do, never how dcpstore decides it (nothing here imports
dcpstore).  Jepsen's idea: keep the history of what each client was told,
then hold storage and the stock readers against it (``invariants.py``).

* A step is what each save reported: committed (it must load bit-exact,
  with dcpstore and with stock ``FsspecReader``), failed (nothing of that
  save may be loadable there; what was committed there before still is),
  or unknown (either is fine; the next look at storage settles it).
* Deleting entitlements: a committed step may go only by retention
  (``keep_last``, as the README states the rule: the newest commit and its
  lineage first, then the most recent), ``gc --keep-last``, or the user.
* An export is what ``export_hf`` reported: its index names shards that
  hold the step's tensors, and nothing else of it stays in the folder.
* Planted steps are nobody's commit: readers refuse them, and no byte of
  them may run (the sentinel directory never appears).
"""

from __future__ import annotations

import dataclasses
import time

import torch

ABSENT = None  # an acceptable content of a step: no checkpoint there


@dataclasses.dataclass
class Step:
    """One step folder as the user knows it."""

    number: int
    contents: list  # acceptable contents: state dicts, or ABSENT; one entry once settled
    sequence: int | None = None  # the oracle's commit order, once known committed
    committed_at: float = 0.0  # time.monotonic() of the commit (orders unsequenced writers' commits)
    parent: int | None = None  # the step its job continued from (AsyncCheckpointer saves only)
    sequenced: bool = False  # written by an AsyncCheckpointer: its commit order is recorded, not timed
    removable: bool = False  # retention, gc or the user may have deleted it
    tampered: bool = False  # a bucket writer changed its bytes: dcpstore must refuse it or load it exact; stock is unchecked

    @property
    def committed(self) -> bool:
        return len(self.contents) == 1 and self.contents[0] is not ABSENT


@dataclasses.dataclass
class Export:
    step: int
    tensors: dict[str, torch.Tensor]  # the names and values the export must hold


class Oracle:
    def __init__(self):
        self.steps: dict[int, Step] = {}
        self.exports: dict[str, Export] = {}  # folder -> what its committed index must serve
        self.planted: dict[int, float] = {}  # step -> time.monotonic() of the plant: an unsequenced commit to retention
        self.planted_from: dict[int, int] = {}  # planted step -> the committed step it copies
        self.sequence = 0

    # -- saves ---------------------------------------------------------------------------------

    def step(self, number: int) -> Step:
        return self.steps.setdefault(number, Step(number, [ABSENT]))

    def committed(self, number: int, content: dict, parent: int | None = None, sequenced: bool = False) -> None:
        self.sequence += 1
        self.steps[number] = Step(number, [content], self.sequence, time.monotonic(), parent, sequenced)

    def failed(self, number: int) -> None:
        """A save reported failed: what was there before still is (an overwrite loses nothing)."""
        self.step(number)

    def unknown(self, number: int, content: dict, parent: int | None = None, sequenced: bool = False) -> None:
        """A save whose outcome the user was not told (an unknown outcome, a killed process)."""
        before = self.step(number)
        self.sequence += 1
        before.contents = [*before.contents, content]
        before.sequence, before.committed_at, before.parent, before.sequenced = self.sequence, time.monotonic(), parent, sequenced

    def settle(self, number: int, content) -> None:
        """Storage answered for an unknown outcome: from now on the step holds ``content``."""
        self.steps[number].contents = [content]
        if content is ABSENT:
            self.steps[number].sequence = None  # not a commit after all

    def plant(self, number: int, source: int | None = None) -> None:
        self.planted[number] = time.monotonic()
        if source is not None:
            self.planted_from[number] = source

    # -- retention ------------------------------------------------------------------------------

    def keep_last(self, keep_last: int, just_committed: int | None = None) -> None:
        """Mark what ``keep_last`` may delete: all but the steps the README's rule keeps for sure.

        The rule: the newest commit and its lineage first, then the most
        recently committed; a checkpointer's retention never deletes the
        step it just reported committed (``just_committed``).  Commits of
        writers that record no order (plain ``dcp.save``, stock writers,
        plants) are ordered by time on the server's one-second clock; when
        the newest commit is not clearly the newest, only that step is kept
        for sure.
        """
        if len(self._commits()) + len(self.planted) <= keep_last:
            return  # nothing to prune, even counting the steps that may be gone already
        committed = [s for s in self._commits() if not s.removable]
        newest = self.clear_newest()
        keep: list[int] = [just_committed] if just_committed is not None else []
        if newest is not None and not self.planted_from:  # a planted copy carries a commit record of its own
            by_number = {s.number: s for s in committed}  # retention follows a parent only while it is there
            step: Step | None = newest
            while step is not None and step.number not in keep and len(keep) < keep_last:
                keep.append(step.number)
                step = by_number.get(step.parent) if step.parent is not None else None
        for s in committed:
            if s.number not in keep:
                s.removable = True

    def _commits(self) -> list[Step]:
        return sorted((s for s in self.steps.values() if s.sequence is not None), key=lambda s: s.sequence)

    def clear_newest(self) -> Step | None:
        """The newest commit, if storage's commit order surely agrees: ``None`` while an outcome is unsettled or two commits are too close.

        Commits of writers that record no order (plain ``dcp.save``, stock
        writers, plants) are ordered by time on the server's one-second clock.
        """
        committed = self._commits()  # with the steps that may be gone: storage may still hold them
        if not committed or not all(s.committed for s in committed) or committed[-1].removable:
            return None
        newest = committed[-1]
        times = [s.committed_at for s in committed[:-1] if not (s.sequenced and newest.sequenced)]
        times += [t for number, t in self.planted.items() if number not in self.planted_from]
        return newest if all(newest.committed_at - t > 2.0 for t in times) else None

    # -- exports ---------------------------------------------------------------------------------

    def exported(self, folder: str, step: int, tensors: dict[str, torch.Tensor]) -> None:
        self.exports[folder] = Export(step, tensors)


def flat_tensors(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a state dict under DCP's flattened names (``model.embed.weight``)."""
    out = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_tensors(value, f"{name}."))
        elif isinstance(value, torch.Tensor):
            out[name] = value
    return out


def equal_states(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, dict):
            if not isinstance(y, dict) or not equal_states(x, y):
                return False
        elif isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True
