"""Worker classes with injected faults for the ray trainer tests (importable by the ray workers)."""

from __future__ import annotations

import os
import time

from verl_dmd.workers.worker import DiffusionDistillationWorker, operation

FAULT_PHASE = 2
"""The phase (index) at which rank 1 misbehaves."""


class RaisingWorker(DiffusionDistillationWorker):
    """Rank 1 raises in its third phase; rank 0 is then stuck in that phase's collectives."""

    @operation("run_phase")
    def run_phase(self, request, batch):
        if self.rank == 1 and request.phase_index == FAULT_PHASE:
            raise ValueError("injected failure on purpose")
        return super().run_phase(request, batch)


class HangingWorker(DiffusionDistillationWorker):
    """Rank 1 stops answering in its third phase (it sleeps far beyond the timeout)."""

    @operation("run_phase")
    def run_phase(self, request, batch):
        if self.rank == 1 and request.phase_index == FAULT_PHASE:
            time.sleep(float(os.environ.get("VERL_DMD_TEST_HANG_S", "3600")))
        return super().run_phase(request, batch)


class DyingWorker(DiffusionDistillationWorker):
    """Rank 1's process exits in its third phase (as after an out-of-memory kill)."""

    @operation("run_phase")
    def run_phase(self, request, batch):
        if self.rank == 1 and request.phase_index == FAULT_PHASE:
            os._exit(3)
        return super().run_phase(request, batch)


class SaveDyingWorker(DiffusionDistillationWorker):
    """Rank 1's process exits right after its part of the first checkpoint's save: the checkpoint is
    published on disk, but the driver's save call fails."""

    @operation("save_checkpoint")
    def save_checkpoint(self, global_step, trainer_state):
        path = self.session.save_checkpoint(global_step, trainer_state)
        if self.rank == 1:
            os._exit(3)
        return path
