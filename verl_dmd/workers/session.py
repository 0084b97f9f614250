"""What one rank holds for a run and the operations the driver asks of it.

`RankSession` is plain Python over an initialised process group: the verl worker
(`verl_dmd.workers.worker`) wraps each method as a registered RPC, and the
in-process group (`verl_dmd.workers.group.LocalWorkerGroup`) calls it directly.
Every method is collective: all ranks call it with their part of the inputs.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import torch

from verl_dmd.phases import PhaseRequest, Role


def resolve_device(plan, local_rank: int = 0) -> torch.device:
    """`resources.device` as a torch device (auto: this rank's GPU when torch sees one, else CPU)."""
    wanted = plan.resources.device
    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    if wanted == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                "config key 'resources.device' = 'cuda': torch sees no GPU on this worker; fix: "
                "resources.device=cpu (or auto)"
            )
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class WorkerInfo:
    """What the driver learns about the model when the workers are ready (from rank 0)."""

    rank: int
    device: str
    null_class: int | None
    """The class label that means "no class" for class-conditional families (DiT), else None."""
    parameter_bytes: dict[str, int]
    sigma_max: float
    """The model adapter's highest noise level (sampling schedules start there)."""
    matmul_flops_per_s: float | None = None
    """The bf16 matmul rate measured on the device at start (CUDA only): MFU's practical denominator."""
    datasheet: tuple[str, float] | None = None
    """(device name, dense bf16 FLOP/s of its datasheet) for known GPUs: MFU's datasheet denominator."""
    init_seconds: dict[str, float] | None = None
    """Where rank 0's start went (seconds, in order): the process group, the engine's model build, placement
    and sharding, optimizers, and the matmul probe; the driver logs it beside the total."""
    attention_kernels_off: tuple[str, ...] = ()
    """The attention kernels switched off on CUDA for this family (its adapter's `excluded_attention_kernels`)."""


class RankSession:
    """The phase computer, the engine and the runtime of one rank, built from the plan.

    The computer is built first: the modules it declares (`PhaseComputer.extra_modules`) are part of
    what the engine builds and shards.
    """

    def __init__(self, plan, *, rank: int, world_size: int, device: torch.device | str = "cpu") -> None:
        from verl_dmd import seeding
        from verl_dmd.adapters import get_adapter
        from verl_dmd.runtime.attention import switch_off_for
        from verl_dmd.runtime.engine import RoleEngine
        from verl_dmd.runtime.offload import StateOffloader
        from verl_dmd.runtime.runtime import DistillationRoleRuntime

        seeding.seed_host_generators(plan.trainer.seed, rank)
        if plan.resources.deterministic:
            seeding.use_deterministic_kernels()
        self.plan = plan
        self.rank, self.world_size = rank, world_size
        self.adapter = get_adapter(plan.model.adapter)()
        self._attention_before, self.attention_kernels_off = switch_off_for(
            self.adapter.excluded_attention_kernels, device
        )
        try:  # a session that fails to build (out of memory, a bad checkpoint) gives the switches back
            self.computer = self.adapter.build_distribution_matching_computer(plan.model, plan, rank=rank)
            self.engine = RoleEngine(
                plan, self.adapter, device=device, extra_modules=self.computer.extra_modules()
            )
            self.runtime = DistillationRoleRuntime(self.engine, self.computer)
            self.init_seconds: dict[str, float] = dict(self.engine.init_seconds)
            packing = plan.resources.offload_packing
            self.offloader = StateOffloader(
                self.engine, pack=packing, **({} if packing else {"coalesce_below": 0})
            )
        except BaseException:
            self.close()
            raise

    def describe(self) -> WorkerInfo:
        """What the driver needs to know about the model."""
        from verl_dmd.runtime.flops import datasheet_rate, measure_matmul_rate

        teacher = self.engine.module_for(Role.TEACHER)
        if not hasattr(self, "_matmul_rate"):  # 2 s of matmuls, once
            started = time.perf_counter()
            self._matmul_rate = measure_matmul_rate(self.engine.device, seconds=2.0)
            self.init_seconds["matmul probe"] = time.perf_counter() - started
        return WorkerInfo(
            rank=self.rank,
            device=str(self.engine.device),
            null_class=self.adapter.null_class(teacher),
            parameter_bytes=self.engine.parameter_bytes(),
            sigma_max=float(self.adapter.sigma_max),
            matmul_flops_per_s=self._matmul_rate,
            datasheet=datasheet_rate(self.engine.device),
            attention_kernels_off=self.attention_kernels_off,
            init_seconds=dict(self.init_seconds),
        )

    def close(self) -> None:
        """Give back what this session changed in the process: the attention kernels it switched off."""
        if self._attention_before is not None:
            from verl_dmd.runtime.attention import restore_attention_kernels

            restore_attention_kernels(self._attention_before)
            self._attention_before = None

    def run_phase(self, request: PhaseRequest, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        self.wake()
        metrics = self.runtime.run_phase(request, batch)
        if self.plan.resources.sleep_between_phases:
            metrics.update({f"offload/{k}": v for k, v in self.sleep().items()})
        return metrics

    # ------------------------------------------------------------------ device memory

    def sleep(self) -> dict[str, float]:
        """Move the whole state to host memory (a no-op when asleep already)."""
        if self.offloader.asleep:
            return {}
        return self.offloader.sleep()

    def wake(self) -> dict[str, float]:
        """Bring the state back (a no-op when awake); every other method calls it first."""
        if not self.offloader.asleep:
            return {}
        return self.offloader.wake()

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, global_step: int, trainer_state: dict[str, Any]) -> str:
        self.wake()
        from verl_dmd.checkpoint.composite import capture_rng, checkpoint_root, save_checkpoint
        from verl_dmd.checkpoint.store import CheckpointStore

        rank_state = {**capture_rng(), **{f"computer.{k}": v for k, v in self.computer.state_dict().items()}}
        path = save_checkpoint(
            CheckpointStore(checkpoint_root(self.plan)),
            self.engine,
            self.plan,
            global_step=global_step,
            trainer_state=trainer_state,
            rank_state=rank_state,
        )
        return str(path)

    def load_checkpoint(self) -> dict[str, Any] | None:
        """Resolve checkpoint.resume and load it; the driver's part of the state comes back as a dict."""
        self.wake()
        from verl_dmd.checkpoint.composite import checkpoint_root, load_checkpoint, restore_rank_state
        from verl_dmd.checkpoint.store import CheckpointStore

        loaded = load_checkpoint(CheckpointStore(checkpoint_root(self.plan)), self.engine, self.plan)
        if loaded is None:
            return None
        restore_rank_state(loaded, seed=self.plan.trainer.seed, rank=self.rank, computer=self.computer)
        return {
            "path": str(loaded.path),
            "global_step": loaded.global_step,
            "trainer_state": loaded.trainer_state,
            "saved_world_size": loaded.saved_world_size,
        }

    # ------------------------------------------------------------------ sampling

    def euler(
        self,
        role: str,
        noise: torch.Tensor,
        cond: dict[str, torch.Tensor],
        steps: int,
        guidance: float = 1.0,
        uncond: dict[str, torch.Tensor] | None = None,
        chunk: int = 512,
        shift: float = 1.0,
    ) -> torch.Tensor:
        """Euler samples of `role` (the teacher's ODE sampler, its levels shifted by `shift`) for this rank's
        part, `chunk` at a time."""
        self.wake()
        from verl_dmd.algorithms.sampling import euler_sample

        out = []
        with self.engine.use_role(Role(role)) as module:
            for start in range(0, noise.shape[0], chunk):
                part = slice(start, start + chunk)
                out.append(
                    euler_sample(
                        self.adapter, module, noise[part].to(self.engine.device),
                        {k: v[part].to(self.engine.device) for k, v in cond.items()}, steps, guidance=guidance,
                        uncond=None if uncond is None else {k: v[part].to(self.engine.device)
                                                            for k, v in uncond.items()}, shift=shift,
                    ).cpu()
                )  # fmt: skip
        return torch.cat(out)

    def few_step(
        self,
        role: str,
        noise: torch.Tensor,
        cond: dict[str, torch.Tensor],
        schedule: list[float],
        renoise: list[torch.Tensor],
    ) -> torch.Tensor:
        """A few-step student sample of `role` for this rank's part, with pre-drawn re-noising."""
        self.wake()
        from verl_dmd.algorithms.sampling import few_step_sample

        device = self.engine.device
        with self.engine.use_role(Role(role)) as module:
            return few_step_sample(
                self.adapter, module, noise.to(device), {k: v.to(device) for k, v in cond.items()},
                torch.tensor(schedule), [r.to(device) for r in renoise],
            ).cpu()  # fmt: skip

    # ------------------------------------------------------------------ the inference replica (rank 0)

    def sync_replica(self, role: str, components: tuple[str, ...] = ("transformer",),
                     blend: float | None = None) -> dict[str, Any] | None:  # fmt: skip
        """Publish `role`'s weights to the inference replica held by rank 0 (built on first use from the
        teacher's pipeline directory): every rank gathers each full tensor in turn (collective), rank 0 copies
        it in. The replica's check runs before any gather, its verdict shared by every rank, so a refused sync
        moves nothing and every rank raises the same one line. Rank 0 returns the new versions, the seconds
        and the peak bytes; the other ranks None."""
        self.wake()
        import torch.distributed as dist

        from verl_dmd.runtime.weight_sync import WeightSyncPlan, gather_role_weights, role_manifest
        from verl_dmd.workers.replica import ReplicaError

        plan = WeightSyncPlan(role, tuple(components), blend=blend)
        manifests = {"transformer": role_manifest(self.engine, plan.role)}
        verdict = [None]
        if self.rank == 0:
            try:
                self._replica().check(plan, manifests)
            except ReplicaError as err:
                verdict = [str(err)]
            except Exception as err:  # building the replica failed: every rank must hear it, not wait
                lines = str(err).strip().splitlines()
                verdict = [
                    f"the inference replica could not be built: {type(err).__name__}: {lines[-1] if lines else ''}"
                ]
        if self.world_size > 1:
            dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            raise ReplicaError(verdict[0])
        stats: dict[str, float] = {}
        device = self.engine.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        started = time.perf_counter()
        with contextlib.closing(gather_role_weights(self.engine, plan.role, stats)) as weights:
            gathered = (("transformer", name, t) for name, t in weights)
            if self.rank != 0:
                for _ in gathered:  # take part in every gather
                    pass
                return None
            try:
                result = self._replica().sync(plan, manifests, gathered)
            finally:
                for _ in gathered:  # a failed transfer still takes part in the other ranks' gathers
                    pass
        result.update(seconds=time.perf_counter() - started, gathered_peak_bytes=stats.get("gathered_peak_bytes", 0.0),
                      role=plan.role.value, version=self._replica().version("transformer"))  # fmt: skip
        if device.type == "cuda":
            result["peak_extra_bytes"] = float(torch.cuda.max_memory_allocated(device) - before)
        return result

    def replica_few_step(self, noise, cond, schedule, renoise) -> dict[str, Any] | None:
        """Few-step samples by the replica's transformer (rank 0; the others None), with the version sampled."""
        if self.rank != 0:
            return None
        replica = self._replica()
        return {
            "samples": replica.few_step(noise, cond, schedule, renoise),
            "version": replica.version("transformer"),
        }

    def replica_state(self) -> dict[str, Any] | None:
        """Rank 0's replica: per-component versions and sources, and its counters (None elsewhere)."""
        if self.rank != 0:
            return None
        replica = self._replica()
        return {"versions": dict(replica.versions), "sources": dict(replica.sources), **replica.counters}

    def _replica(self):
        if getattr(self, "_replica_instance", None) is None:
            from verl_dmd.data.prepared import teacher_pipeline
            from verl_dmd.workers.replica import InferenceReplica, ReplicaError

            root = teacher_pipeline(self.plan)
            if root is None:
                raise ReplicaError("the inference replica is built from the teacher's pipeline directory "
                                   "(model.teacher.path with model.teacher.subfolder and a model_index.json); "
                                   "this plan's teacher is not in one")  # fmt: skip
            dtype = getattr(torch, self.plan.model.param_dtype)  # float32, bfloat16 or float16
            self._replica_instance = InferenceReplica(
                root, self.adapter, device=self.engine.device, dtype=dtype
            )
        return self._replica_instance

    # ------------------------------------------------------------------ decoding (pipeline validation)

    def decode(self, latents: torch.Tensor, height: int, width: int, chunk: int = 4) -> torch.Tensor:
        """This rank's part of `latents` decoded by the VAE of the teacher's pipeline (loaded on first use,
        kept on the host between calls), as uint8 RGB channels-last: (B, H, W, 3) or (B, F, H, W, 3)."""
        self.wake()
        vae = self._vae()
        device = self.engine.device
        vae.to(device)
        out = []
        try:
            with torch.no_grad():
                for start in range(0, latents.shape[0], chunk):
                    part = latents[start : start + chunk].to(device, torch.float32)
                    pixels = self.adapter.decode_latents(vae, part, height, width).float()
                    pixels = ((pixels.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu()
                    out.append(pixels.movedim(1, -1))  # channels last: (B, H, W, 3) or (B, F, H, W, 3)
        finally:
            vae.to("cpu")
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if not out:
            return torch.zeros((0,), dtype=torch.uint8)
        return torch.cat(out)

    def _vae(self):
        if getattr(self, "_vae_model", None) is None:
            import json

            import diffusers

            from verl_dmd.data.prepared import teacher_pipeline

            root = teacher_pipeline(self.plan)
            if root is None:
                raise ValueError("decoding needs the teacher's pipeline directory (model.teacher.path with "
                                 "model.teacher.subfolder), which holds the VAE")  # fmt: skip
            _, cls = json.loads((root / "model_index.json").read_text())["vae"]
            self._vae_model = (
                getattr(diffusers, cls)
                .from_pretrained(str(root), subfolder="vae", torch_dtype=torch.float32, local_files_only=True)
                .eval()
            )
        return self._vae_model
