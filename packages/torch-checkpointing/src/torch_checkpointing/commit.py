"""The commit protocol: which steps exist, publishing a step, failures, retention and cleanup.

A step is committed exactly when `step-N/commit.json` exists. Ranks write into a work directory
(`.tmp-step-N`, or `step-N` itself where renames are not atomic), each finishing with its record
file; rank 0 polls the storage until every rank's record is there, writes metadata.json, renames the
work directory to `step-N` (fsyncing files and directories) and finally writes commit.json. A crash
before that last write leaves the step invisible, and the next run's first save removes it. A step
that fails (a rank could not write, a full disk) has its work directory removed at once and leaves
`.failed-step-N` with the reason beside the steps, where every rank's wait() reads it.
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from .file_format import (
    COMMIT, METADATA, damaged_dir, failed_step_file, failure_file, parse_record_file, parse_step_dir, step_dir, temp_dir,
)
from .integrity import read_sealed, sealed_json
from .layout import merge_layouts
from .storage import Storage

POLL_START_S, POLL_MAX_S = 0.001, 0.05


class CommitError(RuntimeError):
    """A step could not be committed (a rank failed, timed out, or the ranks' layouts disagree)."""


def work_dir(storage: Storage, step: int) -> str:
    return temp_dir(step) if storage.atomic_rename else step_dir(step)


def committed_steps(storage: Storage) -> list[int]:
    steps = []
    for name in storage.listdir(""):
        step = parse_step_dir(name)
        if step is not None and storage.exists(f"{name}/{COMMIT}"):
            steps.append(step)
    return sorted(steps)


def remove_leftovers(storage: Storage) -> list[str]:
    """Delete what earlier runs left unfinished: temporaries, step dirs without a commit record and
    failure notes (this run may save those steps again)."""
    removed = []
    for name in storage.listdir(""):
        step = parse_step_dir(name)
        stale = (name.startswith((".tmp-step-", ".failed-step-"))  # the latter's half-written ".partial" too
                 or (step is not None and not storage.exists(f"{name}/{COMMIT}")))
        if stale:
            storage.remove(name)
            removed.append(name)
    if removed:
        storage.sync_dir("")
    return removed


def step_outcome(storage: Storage, step: int, later: tuple[int, ...] = ()) -> tuple[str, str]:
    """("committed" | "failed" | "pending", detail), as any rank can tell from the storage alone.

    `later`: steps this run saved after `step`. Rank 0 settles steps in the order they were saved, so
    one of them being committed means `step` was settled too: committed (and since removed by the
    retention policy) unless its failure record says otherwise.
    """
    if storage.exists(f"{step_dir(step)}/{COMMIT}"):
        return "committed", ""
    try:
        return "failed", storage.read_file(failed_step_file(step)).decode(errors="replace")
    except FileNotFoundError:
        pass
    if any(storage.exists(f"{step_dir(s)}/{COMMIT}") for s in later):
        return "committed", ""
    return "pending", ""


def wait_for_outcome(storage: Storage, step: int, timeout_s: float, later: Callable[[], tuple[int, ...]]) -> None:
    deadline, pause = time.monotonic() + timeout_s, POLL_START_S
    while True:
        outcome, detail = step_outcome(storage, step, later())
        if outcome == "committed":
            return
        if outcome == "failed":
            raise CommitError(f"step {step} was not committed: {detail}")
        if time.monotonic() > deadline:
            raise CommitError(f"step {step} was not committed by rank 0 within {timeout_s:.0f} s")
        time.sleep(pause)
        pause = min(pause * 2, POLL_MAX_S)


@dataclass
class RetentionPolicy:
    keep_last: int | None
    keep_every: int | None

    def victims(self, steps: list[int]) -> list[int]:
        if self.keep_last is None:
            return []
        recent = set(sorted(steps)[-self.keep_last:])
        return [s for s in steps if s not in recent and not (self.keep_every and s % self.keep_every == 0)]


def quarantine_step(storage: Storage, step: int) -> str:
    """Move a damaged committed step aside (to damaged-step-N, or .1, .2, ...); returns its new name.

    Out of the way, it no longer counts for "latest", retention or a new save of that step."""
    name, n = damaged_dir(step), 0
    while storage.exists(name):
        n += 1
        name = f"{damaged_dir(step)}.{n}"
    storage.rename(step_dir(step), name)
    storage.sync_dir("")
    return name


def delete_step(storage: Storage, step: int) -> None:
    storage.remove(f"{step_dir(step)}/{COMMIT}")  # invisible first, so a crash mid-delete is harmless
    storage.sync_dir(step_dir(step))
    storage.remove(step_dir(step))


class Committer:
    """Rank 0's side: knows every rank's layout (exchanged once, refreshed from records on change)."""

    def __init__(self, storage: Storage, world_size: int, *, timeout_s: float, retention: RetentionPolicy):
        self.storage, self.world_size = storage, world_size
        self.timeout_s, self.retention = timeout_s, retention
        self.layouts: list[dict | None] = [None] * world_size
        self.fingerprints: list[str | None] = [None] * world_size
        self._metadata: bytes | None = None
        self._metadata_records: list[str] | None = None

    def set_layouts(self, layouts: list[dict], fingerprints: list[str]) -> None:
        self.layouts, self.fingerprints = list(layouts), list(fingerprints)
        self._metadata = None

    def commit(self, step: int) -> None:
        directory = where = work_dir(self.storage, step)
        try:
            records = self._wait_for_records(step, directory)
            metadata = self._metadata_for(directory, records)
            self.storage.write_file(f"{directory}/{METADATA}", metadata)
            if directory != step_dir(step):
                self.storage.sync_dir(directory)
                self.storage.rename(directory, step_dir(step))
                where = step_dir(step)
                self.storage.sync_dir("")
            self.storage.write_file(
                f"{step_dir(step)}/{COMMIT}",
                sealed_json({"step": step, "world_size": self.world_size, "committed_at": time.time()}),
            )
        except Exception as e:
            error = e if isinstance(e, CommitError) else CommitError(f"step {step} was not committed: {e}")
            self.fail(step, where, str(error))
            if error is e:
                raise
            raise error from e

    def fail(self, step: int, where: str, reason: str) -> None:
        """Give up on `step`: remove its unfinished folder `where`, then tell the other ranks why.

        Removing first frees the space a full disk needs for the note. A rank still writing its part
        may recreate the folder; the next run's first save removes it.
        """
        try:
            if not self.storage.exists(f"{where}/{COMMIT}"):  # a commit record means it is visible: keep it
                self.storage.remove(where)
        except OSError as e:
            warnings.warn(f"could not remove the unfinished {self.storage.describe(where)}: {e}", RuntimeWarning, stacklevel=2)
        try:
            self.storage.write_file(failed_step_file(step), reason.encode())  # other ranks' wait() reads it
        except OSError as e:
            warnings.warn(f"could not record that step {step} failed ({e}); other ranks learn it at their commit "
                          "timeout", RuntimeWarning, stacklevel=2)

    def apply_retention(self) -> None:
        for victim in self.retention.victims(committed_steps(self.storage)):
            try:
                delete_step(self.storage, victim)
            except OSError as e:  # housekeeping: the next commit tries again
                warnings.warn(f"could not delete old step {victim}: {e}", RuntimeWarning, stacklevel=1)

    def _wait_for_records(self, step: int, directory: str) -> list[str]:
        deadline, pause = time.monotonic() + self.timeout_s, POLL_START_S
        while True:
            names = self.storage.listdir(directory)
            records: dict[int, str] = {}
            for name in names:
                parsed = parse_record_file(name)
                if parsed is not None:
                    records[parsed[0]] = name
            failed = sorted(r for r in range(self.world_size) if failure_file(r) in names)
            if failed:
                detail = self.storage.read_file(f"{directory}/{failure_file(failed[0])}").decode(errors="replace")
                raise CommitError(f"step {step}: rank(s) {failed} failed to write their part:\n{detail}")
            if len(records) == self.world_size:
                return [records[r] for r in range(self.world_size)]
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(records))
                raise CommitError(f"step {step}: ranks {missing[:16]} did not finish within {self.timeout_s:.0f} s")
            time.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)

    def _metadata_for(self, directory: str, records: list[str]) -> bytes:
        """Cached metadata.json bytes; rebuilt only when some rank's layout fingerprint changed."""
        layouts, fingerprints = list(self.layouts), list(self.fingerprints)
        for rank, name in enumerate(records):
            fingerprint = parse_record_file(name)[1]
            if fingerprint != fingerprints[rank]:
                # That rank's layout changed since the exchange: its record carries the new one.
                layouts[rank] = read_sealed(self.storage, f"{directory}/{name}")["layout"]
                fingerprints[rank] = fingerprint
        if self._metadata is None or fingerprints != self.fingerprints or records != self._metadata_records:
            metadata = sealed_json(merge_layouts(layouts, records))  # raises if the ranks now disagree
            self.layouts, self.fingerprints = layouts, fingerprints
            self._metadata, self._metadata_records = metadata, records
        return self._metadata
