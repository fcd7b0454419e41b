"""The Checkpointer: save (asynchronous by default), load with resharding, list and retain steps."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .commit import (
    Committer, CommitError, RetentionPolicy, committed_steps, quarantine_step, remove_leftovers, step_outcome,
    wait_for_outcome, work_dir,
)
from .config import CheckpointerConfig, group_rank_and_size
from .file_format import COMMIT, dtype_name, record_file, step_dir, tensor_bytes
from .integrity import ChecksumError, find_damage
from .layout import RankLayout, build_rank_layout, layout_key, leaf_kind, merge_layouts
from .rank_writer import ExtraPiece, write_rank
from .sharding import box_view
from .reader import StepReader, load_step
from .staging import HostPool, Staged, StagingPlan, plan_staging, stage
from .state_tree import encode_value, flatten
from .storage import Storage, storage_for

_PLAN_CACHE_SIZE = 4  # layouts remembered (e.g. alternating model-only and full saves)


def _rank_list(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


class SaveHandle:
    """One save in progress.

    `staged()` / `wait_staged()`: the state has been copied to host memory and may change. By default
    `save()` already orders the current CUDA stream after the copies, so work queued later on it
    (an optimizer step) is safe without waiting; `wait_staged()` also waits on the host.
    `order_current_stream()`: after `save(manual_release=True)`, orders the current stream after the
    copies then (just before the optimizer step), so the work queued between overlaps them.
    `wait()`: the step is durable and committed on storage (or raises why not).
    """

    def __init__(self, checkpointer: Checkpointer, step: int, staged: Staged, local: Future, commit: Future | None):
        self.step = step
        self._checkpointer, self._staged, self._local, self._commit = checkpointer, staged, local, commit
        self._committed = False
        self._raised = False  # its failure reached the caller once; Checkpointer.wait/close skip it

    def staged(self) -> bool:
        return self._staged.ready()

    def wait_staged(self) -> None:
        self._staged.wait()

    def order_current_stream(self) -> None:
        """Make the current CUDA stream of every device the state lives on wait for this save's copies,
        without blocking the host: work queued on that stream afterwards may change the state.

        save() does this itself unless manual_release=True; a trainer that saves with manual_release
        calls it right before its optimizer step, so the forward and backward passes queued in between
        run while the copies do. On CPU the copies ended in save() and there is nothing to order.
        """
        self._staged.order_current_streams()

    def _finished_ok(self) -> bool:
        """This rank's part is done without error (rank 0: the commit as well)."""
        return all(f.done() and f.exception() is None for f in (self._local, self._commit) if f is not None)

    def _failed(self) -> bool:
        """Known to have failed, without waiting (on ranks other than 0 this asks the storage)."""
        if any(f.done() and f.exception() is not None for f in (self._local, self._commit) if f is not None):
            return True
        if self._commit is None and self._local.done():
            outcome = self._checkpointer._outcome(self.step)
            self._committed = outcome == "committed"
            return outcome == "failed"
        return False

    def done(self) -> bool:
        if self._committed:
            return True
        if self._commit is not None:
            return self._commit.done()
        return self._local.done() and self._checkpointer._outcome(self.step) != "pending"

    def wait(self, timeout: float | None = None) -> None:
        if self._committed:
            return
        try:
            try:
                self._local.result(timeout)
            except Exception as e:
                if self._commit is not None:  # rank 0: raise once the unfinished folder is cleaned up
                    wait_futures([self._commit])
                    raise
                outcome, detail = step_outcome(self._checkpointer.storage, self.step)
                if outcome == "failed":  # rank 0 gave up first (and removed the folder)
                    raise CommitError(f"step {self.step} was not committed: {detail}") from e
                raise
            if self._commit is not None:
                self._commit.result(timeout)
            else:
                ckpt = self._checkpointer
                wait_for_outcome(ckpt.storage, self.step, timeout or ckpt.config.commit_timeout_s,
                                 later=lambda: ckpt._saved_after(self.step))
        except BaseException:
            self._raised = True
            raise
        self._committed = True

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, staged={self.staged()}, done={self.done()})"


@dataclasses.dataclass(slots=True)
class _Plan:
    layout: RankLayout
    staging: StagingPlan


class Checkpointer:
    """Saves and loads steps of a (possibly distributed) state under one path or storage.

    `Checkpointer(path_or_storage, config=None, *, process_group=None, **fields)`: fields override
    the config's (e.g. keep_last=3). Every rank of the process group makes the same calls.
    """

    def __init__(
        self,
        path_or_storage: str | os.PathLike | Storage,
        config: CheckpointerConfig | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
        **fields: Any,
    ):
        config = config or CheckpointerConfig()
        unknown = set(fields) - {f.name for f in dataclasses.fields(CheckpointerConfig)}
        if unknown:
            allowed = ", ".join(f.name for f in dataclasses.fields(CheckpointerConfig))
            raise TypeError(f"unknown Checkpointer settings {sorted(unknown)}; allowed: {allowed}")
        self.config = dataclasses.replace(config, **fields)
        self.storage = storage_for(path_or_storage)
        self.process_group = process_group
        self.rank, self.world_size = group_rank_and_size(process_group)
        self._io = ThreadPoolExecutor(self.config.io_threads, thread_name_prefix="ckpt-io")
        self._reads = ThreadPoolExecutor(self.config.read_threads, thread_name_prefix="ckpt-read")  # started by a load
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-write")
        self._committer_thread = ThreadPoolExecutor(1, thread_name_prefix="ckpt-commit") if self.rank == 0 else None
        self._committer = Committer(
            self.storage, self.world_size, timeout_s=self.config.commit_timeout_s,
            retention=RetentionPolicy(self.config.keep_last, self.config.keep_every),
        ) if self.rank == 0 else None
        self._pool = HostPool()
        self._reservation: Future | None = None  # host slabs being allocated by reserve()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._plans: dict[tuple, _Plan] = {}
        self._exchanged = False
        self._handles: list[SaveHandle] = []
        self._saved_steps: list[int] = []  # in save order: a later one committed settles earlier ones
        self._closed = False

    # ---- saving ----------------------------------------------------------------------------

    def reserve(self, state: dict) -> Future:
        """Prepare for saving `state` (or any state of the same layout) so the first save costs what
        later ones do: lay it out, exchange the layouts (collectives: every rank calls reserve() where it
        would call save()), and allocate the host staging memory (pinned for CUDA state, 2-3 s per 8 GB)
        on a background thread. Call it once the state has its final shape (after the first optimizer
        step creates the optimizer's moments). Returns a Future done when the memory is ready; a save()
        called before then waits for it (and is as correct as any other). The state is only read for
        its layout, not copied.

        A later save of a state whose layout differs (other shapes, new entries) is planned anew, as
        any layout change is: its staging reuses the reserved slabs and allocates only those missing,
        and the ranks' layouts are re-checked through storage, not by a collective (raising instead
        would break trainers whose state changes, and a collective would hang if only some ranks changed).
        """
        self._check_open()
        tree, _, plan = self._prepare(state)
        sources = self._sources(tree.leaves, plan.layout)
        pinned = any(s.device.type == "cuda" for s in sources)
        self._side_streams({s.device for s in sources if s.device.type == "cuda"})
        if self._reservation is not None:  # one allocation at a time: the pool is not shared between threads
            wait_futures([self._reservation])
        self._reservation = self._writer.submit(
            self._pool.take, plan.staging.num_slabs, plan.staging.slab_bytes, pinned, touch=True)
        self._start_threads()
        return self._reservation

    def _start_threads(self) -> None:
        """Start the I/O and commit threads now (executors start them at their first tasks, which on a
        busy host costs the first save milliseconds): each I/O task waits until all have started."""
        started = threading.Barrier(self.config.io_threads)
        wait_futures([self._io.submit(started.wait) for _ in range(self.config.io_threads)])
        if self._committer_thread is not None:
            self._committer_thread.submit(lambda: None).result()

    def save(self, step: int, state: dict, *, blocking: bool = False, manual_release: bool = False) -> SaveHandle:
        """Save `state` as `step`; returns once the state has been staged (see SaveHandle).

        blocking: also wait until the step is committed.
        manual_release: do not order the current CUDA stream after the staging copies; the caller
            calls handle.order_current_stream() (or handle.wait_staged()) before changing the state.
        """
        self._check_open()
        self.raise_if_failed()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if step in self._saved_steps:
            raise ValueError(f"step {step} was already saved by this Checkpointer")
        if self._handles:  # its staging buffers are about to be reused
            wait_futures([self._handles[-1]._local])
        tree, kinds, plan = self._prepare(state)
        if self.storage.exists(f"{step_dir(step)}/{COMMIT}"):
            raise ValueError(f"step {step} is already committed in {self.storage}; delete it or save another step")
        sources = self._sources(tree.leaves, plan.layout)
        extras, values = self._per_rank_entries(tree.leaves, kinds)
        streams = self._side_streams({s.device for s in sources if s.device.type == "cuda"})
        self._finish_reservation()
        staged = stage(plan.staging, plan.layout.pieces, sources, self._pool, streams, direct_cpu=blocking)
        if not manual_release:
            staged.order_current_streams()
        local = self._writer.submit(self._write_local, step, plan, staged, extras, values)
        commit = None
        if self._committer_thread is not None:
            commit = self._committer_thread.submit(self._commit, step, local)
            # deleting old steps is not part of committing this one: wait() does not wait for it,
            # the next commit (same thread) and Checkpointer.wait()/close() do
            self._committer_thread.submit(self._committer.apply_retention)
        try:  # the CPU copies, while the writer already writes the slabs copied before
            staged.copy_on_host()
        except BaseException:
            wait_futures([f for f in (local, commit) if f is not None])  # they fail too: nothing half-written stays
            raise
        handle = SaveHandle(self, step, staged, local, commit)
        self._saved_steps.append(step)
        # Saves that finished well need no tracking; the newest stays (its buffers are reused next).
        # On ranks other than 0 a save is finished once rank 0 committed it (raise_if_failed, called
        # above, asks the storage), so that a commit failing later is still reported here.
        self._handles = [h for h in self._handles
                         if not (h._committed or h._raised or (h._commit is not None and h._finished_ok()))] + [handle]
        if blocking:
            handle.wait()
        return handle

    def _finish_reservation(self) -> None:
        """Wait for reserve()'s slabs (the pool is not shared between threads). A save called before
        the reservation finished waits here: its copies need every slab before the state may change.
        A reservation that failed (no pinned memory left, say) is not this save's failure: it warns,
        and the save allocates what it needs itself (raising if that fails too)."""
        reservation, self._reservation = self._reservation, None
        if reservation is None:
            return
        error = reservation.exception()
        if error is not None:
            warnings.warn(f"reserve() could not allocate the staging memory ({type(error).__name__}: {error}); "
                          "the save allocates it", RuntimeWarning, stacklevel=3)

    def _side_streams(self, devices: set[torch.device]) -> dict[torch.device, torch.cuda.Stream]:
        """The staging stream of each device (made once: the copies of consecutive saves stay in order)."""
        for device in devices:
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device)
        return {d: self._streams[d] for d in devices}

    def _prepare(self, state: dict):
        """The state's leaves, their kinds and its (cached) plan; the first call exchanges layouts."""
        try:
            tree = flatten(state)
            kinds = [leaf_kind(leaf, self.config.per_rank) for leaf in tree.leaves]
            key = layout_key(tree.leaves, kinds)
            plan = self._plans.get(key) or self._make_plan(key, tree.leaves, kinds)
        except Exception as e:  # whatever it is, the other ranks must hear of it
            if not self._exchanged and self.world_size > 1:
                # The other ranks are about to wait for this one in the layout exchange: take part
                # in it with the error, so they raise too instead of hanging; this rank raises its own.
                with contextlib.suppress(ValueError):
                    self._first_save_exchange(None, failure=f"{type(e).__name__}: {e}")
            raise
        if not self._exchanged:
            self._first_save_exchange(plan.layout)
        return tree, kinds, plan

    def _make_plan(self, key: tuple, leaves, kinds) -> _Plan:
        layout = build_rank_layout(leaves, kinds, rank=self.rank, world_size=self.world_size)
        sources = self._sources(leaves, layout)
        plan = _Plan(layout, plan_staging(layout.pieces, sources, slab_bytes=self.config.slab_bytes,
                                                  block_bytes=self.config.block_bytes))
        if len(self._plans) >= _PLAN_CACHE_SIZE:
            self._plans.pop(next(iter(self._plans)))
        self._plans[key] = plan
        return plan

    def _sources(self, leaves, layout: RankLayout) -> list[torch.Tensor]:
        out = []
        for piece in layout.pieces:
            value = leaves[piece.leaf].value
            local = value._local_tensor if isinstance(value, DTensor) else value
            out.append(box_view(piece.path, local, piece.box))
        return out

    def _per_rank_entries(self, leaves, kinds) -> tuple[list[ExtraPiece], dict]:
        extras, values = [], {}
        for leaf, kind in zip(leaves, kinds):
            if kind == "value":
                values[leaf.path] = {"value": encode_value(leaf.value)}
            elif kind == "bytes":
                data = bytes(leaf.value)
                extras.append(ExtraPiece(leaf.path, "U8", (len(data),), memoryview(data), data))
                values[leaf.path] = {"bytes": leaf.path}
            elif kind == "rank_tensor":
                copy = leaf.value.detach().to("cpu", copy=True).contiguous()
                extras.append(ExtraPiece(leaf.path, dtype_name(copy.dtype, leaf.path), tuple(copy.shape),
                                         tensor_bytes(copy), copy))
                values[leaf.path] = {"tensor": leaf.path}
        return extras, values

    def _first_save_exchange(self, layout: RankLayout | None, *, failure: str | None = None) -> None:
        """The only collectives: every rank's layout (or why it has none) gathered on rank 0, which
        checks them and tells every rank the verdict (so all raise the same error, or none does).

        Rank 0 removes earlier runs' unfinished steps first; no rank writes before the verdict
        arrives, so nothing new is removed.
        """
        error = None
        mine = (layout.record, layout.fingerprint, None) if layout is not None else (None, None, failure)
        gathered: list[Any] = [mine]
        if self.rank == 0:
            remove_leftovers(self.storage)
        if self.world_size > 1:
            gathered = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object(mine, gathered, dst=self._global_rank(0), group=self.process_group)
        if self.rank == 0:
            failures: dict[str, list[int]] = {}
            for r, g in enumerate(gathered):
                if g[2] is not None:
                    failures.setdefault(g[2], []).append(r)
            if failures:
                error = "the state cannot be saved on every rank: " + "; ".join(
                    f"rank{'s' if len(ranks) > 1 else ''} {_rank_list(ranks)}: {message}" for message, ranks in failures.items()
                )
            else:
                try:
                    merge_layouts([g[0] for g in gathered], [record_file(r, g[1]) for r, g in enumerate(gathered)])
                    self._committer.set_layouts([g[0] for g in gathered], [g[1] for g in gathered])
                except ValueError as e:
                    error = f"the ranks' states do not fit together: {e}"
        if self.world_size > 1:
            verdict = [error]
            dist.broadcast_object_list(verdict, src=self._global_rank(0), group=self.process_group)
            error = verdict[0]
        if error is not None:
            raise ValueError(error)
        self._exchanged = True

    def _global_rank(self, group_rank: int) -> int:
        if self.process_group is None:
            return group_rank
        return dist.get_global_rank(self.process_group, group_rank)

    def _write_local(self, step: int, plan: _Plan, staged: Staged, extras, values) -> None:
        directory = work_dir(self.storage, step)
        self.storage.makedirs(directory)
        try:
            write_rank(
                self.storage, directory, step=step, rank=self.rank, layout=plan.layout, plan=plan.staging,
                staged=staged, extras=extras, values=values, block_bytes=self.config.block_bytes, io_pool=self._io,
                io_threads=self.config.io_threads,
            )
        finally:
            staged.keepalive.clear()  # let go of the state's tensors once their bytes are written

    def _commit(self, step: int, local: Future) -> None:
        try:
            local.result()
        except BaseException as e:
            self._committer.fail(step, work_dir(self.storage, step), f"rank 0 failed to write: {type(e).__name__}: {e}")
            raise
        self._committer.commit(step)

    def _saved_after(self, step: int) -> tuple[int, ...]:
        return tuple(self._saved_steps[self._saved_steps.index(step) + 1:])

    def _outcome(self, step: int) -> str:
        return step_outcome(self.storage, step, self._saved_after(step))[0]

    def raise_if_failed(self) -> None:
        """Raise, as a CommitError naming the step, the failure of an asynchronous save that failed
        and was not reported yet; saves still in flight are not waited for. A trainer calls this
        every step so that a failing save (a full disk, a read-only folder) stops the run at once
        rather than at its end; save() checks it too. The failed step's unfinished folder is already
        removed, and the steps committed before it stay loadable.
        """
        self._check_open()
        for handle in list(self._handles):
            if handle._raised or handle._committed or not handle._failed():
                continue
            try:
                handle.wait()
            except CommitError:
                raise
            except Exception as e:
                raise CommitError(f"step {handle.step} was not saved: {type(e).__name__}: {e}") from e

    def wait(self) -> None:
        """Wait until every save so far is committed; raises the first failure not raised before."""
        for handle in list(self._handles):
            if not handle._raised:
                handle.wait()
        if self._committer_thread is not None:
            self._committer_thread.submit(lambda: None).result()  # retention queued behind commits

    # ---- steps -----------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return committed_steps(self.storage)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    # ---- loading ---------------------------------------------------------------------------

    def load(self, state: dict, step: int | None = None) -> int:
        """Fill `state` in place from `step` (default: the latest intact committed step); returns the step.

        Tensors and DTensors are copied into (resharded from whatever layout saved them); plain
        values are replaced in their containers; stateful objects get load_state_dict() afterwards.
        Entries of the checkpoint that `state` lacks are ignored; the reverse is an error.

        A damaged step (a record or the metadata that does not match its checksum, a data file
        missing, cut short or with damaged bytes) raises ChecksumError naming the file when `step`
        names it; for the latest, it is moved aside (to damaged-step-N) with a warning saying how to
        delete it, and the next older step is loaded. On several ranks every rank loads the same step:
        after each step tried they exchange what they found (one all_gather_object).
        """
        self._check_open()
        for handle in self._handles:  # every rank must see the outcome of saves in flight to agree on "latest"
            raised = handle._raised
            try:
                handle.wait()
            except Exception:
                handle._raised = raised  # still that handle's to report
        steps = self.steps()
        if step is not None:
            if step not in steps:
                raise ValueError(f"step {step} is not committed in {self.storage}; committed steps: {steps[-20:]}")
            damage = self._load_step(state, step)
            if damage is not None:
                raise ChecksumError(f"step {step} cannot be loaded: {damage}")
            return step
        if not steps:
            raise ValueError(f"no committed step to load in {self.storage}")
        found = []
        for candidate in reversed(steps):
            damage = self._load_step(state, candidate)
            if damage is None:
                return candidate
            found.append(f"step {candidate}: {damage}")
            if self.rank == 0:
                self._set_aside(candidate, damage)
        raise ChecksumError(f"every committed step in {self.storage} is damaged (moved aside as damaged-step-N): "
                            + "; ".join(found[:8]))

    def _load_step(self, state: dict, step: int) -> str | None:
        """Load `step` into `state`, or say what is damaged in it (agreed by every rank)."""
        damage, error = None, None
        try:
            # on several ranks each checks a share of the rank records; the exchange combines them
            damage = find_damage(self.storage, step, share=(self.rank, self.world_size))
            if damage is None:
                tree = flatten(state)
                reader = StepReader(self.storage, step, verify=self.config.verify, io_pool=self._reads,
                                    world_size=self.world_size, chunk_bytes=self.config.read_chunk_bytes)
                load_step(reader, tree.leaves, per_rank=self.config.per_rank, rank=self.rank)
        except ChecksumError as e:
            damage = str(e)
        except Exception as e:  # noqa: BLE001 - the other ranks must hear of it, or they would wait
            error = e
        if self.world_size > 1:
            mine = ("error", f"{type(error).__name__}: {error}") if error else ("damage", damage) if damage else None
            everyone: list[Any] = [None] * self.world_size
            dist.all_gather_object(everyone, mine, group=self.process_group)
            if error is not None:
                raise error
            failed = [(r, o[1]) for r, o in enumerate(everyone) if o is not None and o[0] == "error"]
            if failed:
                raise ValueError(f"loading step {step} failed on rank(s) {_rank_list([r for r, _ in failed])}: {failed[0][1]}")
            damage = damage or next((o[1] for o in everyone if o is not None), None)
        elif error is not None:
            raise error
        if damage is None:
            for obj, inner in reversed(tree.statefuls):
                obj.load_state_dict(inner)
        return damage

    def _set_aside(self, step: int, damage: str) -> None:
        """Move a damaged step out of the way (so "latest", retention and a new save of it ignore it)."""
        try:
            moved = self.storage.describe(quarantine_step(self.storage, step))
            action = f"It was moved to {moved}; delete it (rm -r {moved}) once you no longer need it"
        except OSError as e:
            where = self.storage.describe(step_dir(step))
            action = f"It could not be moved aside ({e}); delete it (rm -r {where})"
        warnings.warn(f"step {step} in {self.storage} is damaged and was not loaded: {damage}. {action}. "
                      "Loading the next older step.", RuntimeWarning, stacklevel=3)

    # ---- export ----------------------------------------------------------------------------

    def export_hf(self, out: str | os.PathLike | Storage, *, step: int | None = None, prefix: str = "model.",
                  rename=None, dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 10**9) -> list[str]:
        """Write the tensors under `prefix` of a committed step as a Hugging Face-style folder.

        See torch_checkpointing.hf_export.export_hf; every rank writes its share of the files.
        """
        from .hf_export import export_hf

        steps = self.steps()
        step = steps[-1] if step is None and steps else step
        if step is None or step not in steps:
            raise ValueError(f"step {step} is not committed in {self.storage}; committed steps: {steps[-20:]}")
        reader = StepReader(self.storage, step, verify=self.config.verify, io_pool=self._reads, world_size=self.world_size,
                            chunk_bytes=self.config.read_chunk_bytes)
        return export_hf(reader, storage_for(out), prefix=prefix, rename=rename, dtype=dtype,
                         max_shard_bytes=max_shard_bytes, rank=self.rank, world_size=self.world_size,
                         timeout_s=self.config.commit_timeout_s)

    # ---- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for pending saves (raising their failure), then free threads and host buffers."""
        if self._closed:
            return
        try:
            self.wait()
            if self._reservation is not None:  # never used by a save: its failure changed nothing
                wait_futures([self._reservation])
        finally:
            self._closed = True
            self._writer.shutdown(wait=True)
            if self._committer_thread is not None:
                self._committer_thread.shutdown(wait=True)
            self._io.shutdown(wait=True)
            self._reads.shutdown(wait=True)
            self._pool.release()
            self._plans.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this Checkpointer is closed")

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpointer({self.storage!r}, rank={self.rank}, world_size={self.world_size})"
