"""Where each rank stood at a timeout (verl_dmd.workers.status): the status file, its stack dump, and the
driver's verdict from sample dumps; no ray, no process group."""

from __future__ import annotations

import time
from types import SimpleNamespace

from verl_dmd.phases import PhaseRequest, Role
from verl_dmd.workers import status

SENT = 1000.0
HEADER = """# verl_dmd rank status (verl_dmd.workers.status)
rank: {rank}
pid: 4242
host: vm
thread: 0x00007f59b4855b80
operation: run_phase
request: phase 2, fake_score
started: 1970-01-01T00:16:40.100+00:00
started_unix: 1000.100
stack dump after: 18.000 s (trainer.rpc_timeout_s = 20 s)
"""
RAY_LOOP = """  File "/venv/ray/_private/worker.py", line 946 in main_loop
  File "/venv/ray/_private/workers/default_worker.py", line 330 in <module>
"""
OTHER_THREAD = """Thread 0x00007f599ffff6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap
"""
# Rank 1 sleeps in its override of run_phase (tests/ray_workers.py HangingWorker).
SLEEPING = (
    HEADER.format(rank=1)
    + "Timeout (0:00:18)!\n"
    + OTHER_THREAD
    + "\nThread 0x00007f59b4855b80 (most recent call first):\n"
    + '  File "/work/main/tests/ray_workers.py", line 31 in run_phase\n'
    + '  File "/work/main/verl_dmd/workers/worker.py", line 60 in watched\n'
    + RAY_LOOP
)
# Rank 0 waits for it in the fake-score backward's reduce-scatter (FSDP2 over gloo).
IN_COLLECTIVE = (
    HEADER.format(rank=0)
    + "Timeout (0:00:18)!\n"
    + "Thread 0x00007f59b4855b80 (most recent call first):\n"
    + '  File "/venv/torch/distributed/distributed_c10d.py", line 4213 in reduce_scatter_tensor\n'
    + '  File "/venv/torch/distributed/c10d_logger.py", line 81 in wrapper\n'
    + '  File "/venv/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", line 460 in foreach_reduce\n'
    + '  File "/venv/torch/autograd/graph.py", line 829 in _engine_run_backward\n'
    + '  File "/venv/torch/_tensor.py", line 625 in backward\n'
    + '  File "/work/main/verl_dmd/runtime/runtime.py", line 200 in _accumulate\n'
    + RAY_LOOP
    + "\n"
    + OTHER_THREAD
)
# A rank in its own computation that calls into torch (not torch.distributed) is not in a collective.
COMPUTING = (
    HEADER.format(rank=2)
    + "Timeout (0:00:18)!\n"
    + "Thread 0x00007f59b4855b80 (most recent call first):\n"
    + '  File "/venv/torch/nn/functional.py", line 2000 in linear\n'
    + '  File "/venv/diffusers/models/attention.py", line 90 in forward\n'
    + '  File "/venv/torch/distributed/fsdp/_fully_shard/_fsdp_state.py", line 230 in _pre_forward\n'
    + RAY_LOOP
)
# On a GPU the backward runs in autograd's device thread: the operation's thread waits in the engine.
GPU_BACKWARD = (
    HEADER.format(rank=3)
    + "Timeout (0:00:18)!\n"
    + "Thread 0x00007f0000000001 (most recent call first):\n"
    + '  File "/venv/torch/distributed/distributed_c10d.py", line 4213 in reduce_scatter_tensor\n'
    + '  File "/venv/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", line 460 in foreach_reduce\n'
    + "\nThread 0x00007f59b4855b80 (most recent call first):\n"
    + '  File "/venv/torch/autograd/graph.py", line 829 in _engine_run_backward\n'
    + '  File "/venv/torch/_tensor.py", line 625 in backward\n'
    + RAY_LOOP
)


def reports(**texts: str) -> dict[int, status.RankReport]:
    return {int(name[1:]): status.parse_report(int(name[1:]), text) for name, text in texts.items()}


def test_a_sleeping_rank_is_the_one_that_stopped_and_a_rank_in_a_collective_waits_for_it():
    got = reports(r0=IN_COLLECTIVE, r1=SLEEPING)
    assert got[1].state("run_phase", SENT) == "stopped"
    assert got[0].state("run_phase", SENT) == "waiting"
    assert str(got[1].where()) == "ray_workers.py:31 in run_phase"
    assert got[1].request == "phase 2, fake_score" and got[1].fields["rank"] == "1"
    message = status.timeout_message("run_phase", 20.0, [0, 1], got, "/out/hang-x.txt", sent=SENT)
    assert message == (
        "worker call run_phase: rank(s) [1] stopped answering (phase 2, fake_score; at ray_workers.py:31 in "
        "run_phase) within trainer.rpc_timeout_s = 20 s; rank(s) [0] were waiting for them in a collective; "
        "every rank's stack: /out/hang-x.txt; the workers were stopped"
    )


def test_torch_frames_outside_distributed_and_a_gpu_backward_are_classified_by_their_innermost_run():
    got = reports(r2=COMPUTING, r3=GPU_BACKWARD)
    assert got[2].state("run_phase", SENT) == "stopped"  # FSDP2's frame is further out than the model's
    assert got[3].state("run_phase", SENT) == "waiting"  # the device thread is in the reduce-scatter


def test_the_ranks_own_torch_folder_tells_torchs_frames_from_a_users_folder_named_torch():
    mine = (
        HEADER.format(rank=0)
        + "torch: /venv/torch\n"
        + "Timeout (0:00:18)!\nThread 0x00007f59b4855b80 (most recent call first):\n"
        + '  File "/home/me/torch/distributed/spin.py", line 3 in spin\n'
        + RAY_LOOP
    )
    assert status.parse_report(0, mine).state("run_phase", SENT) == "stopped"
    assert (
        status.parse_report(0, mine.replace("torch: /venv/torch\n", "")).state("run_phase", SENT) == "waiting"
    )
    recorded = IN_COLLECTIVE.replace("stack dump after:", "torch: /venv/torch\nstack dump after:")
    assert status.parse_report(0, recorded).state("run_phase", SENT) == "waiting"


def test_when_every_late_rank_waits_in_a_collective_the_message_says_so_and_lists_them_all():
    got = reports(r0=IN_COLLECTIVE, r1=IN_COLLECTIVE.replace("rank: 0", "rank: 1"))
    message = status.timeout_message("run_phase", 20.0, [0, 1], got, "/out/h.txt", sent=SENT)
    assert message.startswith(
        "worker call run_phase: rank(s) [0, 1] did not answer within trainer.rpc_timeout_s = 20 s, every one "
        "waiting in a collective (rank 0: phase 2, fake_score; at distributed_c10d.py:4213 in "
        "reduce_scatter_tensor; rank 1: "
    )
    assert "no rank stopped on its own" in message and message.endswith("the workers were stopped")


def test_ranks_without_a_dump_not_in_the_call_or_answering_late_are_told_apart():
    header = HEADER.format(rank=0)
    got = {
        0: status.parse_report(0, header),  # in the call, no dump (yet)
        1: status.parse_report(1, header + "finished: x (unix 990.000; 3.0 s)\n"),  # an earlier call
        2: status.parse_report(2, header + "finished: x (unix 1022.000; 21.9 s)\n"),  # this one, too late
        3: status.RankReport(rank=3, text="", missing="/out/.ranks/rank_3.txt: No such file or directory"),
        4: status.parse_report(4, header.replace("operation: run_phase", "operation: sleep")),
    }
    states = status.classify("run_phase", [0, 1, 2, 3, 4], got, SENT)
    assert states == {"stopped": [], "waiting": [], "late": [2], "idle": [1, 4], "unknown": [0, 3]}
    message = status.timeout_message("run_phase", 20.0, [0, 1, 2, 3, 4], got, "/out/h.txt", sent=SENT)
    assert (
        "rank(s) [2] answered only after trainer.rpc_timeout_s = 20 s (started 0.1 s after the call was "
        in message
    )
    assert "ran 21.9 s) (fix: raise trainer.rpc_timeout_s" in message
    assert "rank(s) [1, 4] were not in the call" in message
    assert "rank(s) [0, 3] did not answer within trainer.rpc_timeout_s = 20 s and left no stack" in message


def test_the_log_holds_every_ranks_header_and_stack_and_the_times(tmp_path):
    got = reports(r0=IN_COLLECTIVE, r1=SLEEPING)
    path = tmp_path / "hang.txt"
    status.write_log(path, "the message", got, [0, 1], method="run_phase", sent=SENT, directory=tmp_path)
    text = path.read_text()
    assert text.startswith("verl_dmd: the message\n\ncall sent: ") and "(unix 1000.000)" in text
    assert "== rank 0: waiting in a collective (at distributed_c10d.py:4213 in reduce_scatter_tensor)" in text
    assert "== rank 1: stopped answering, not in a collective (at ray_workers.py:31 in run_phase)" in text
    assert IN_COLLECTIVE.rstrip() in text and SLEEPING.rstrip() in text


def test_a_status_file_gets_a_fresh_header_per_operation_and_a_dump_only_while_it_runs(tmp_path):
    path = status.status_file(status.status_dir(tmp_path), 1)
    rank_status = status.RankStatus(path, rank=1, timeout=0.3)  # dump after 0.27 s
    request = PhaseRequest(role=Role.FAKE_SCORE, global_step=1, role_step=1, phase_index=2)

    def base_run_phase():
        with rank_status.watch("run_phase", (request, {}), {}):
            time.sleep(0.6)
            return status.read_report(path.parent, 1)

    def override_run_phase():  # a subclass's override calling super(): one watch, the outer one
        with rank_status.watch("run_phase", (request, {}), {}):
            return base_run_phase()

    during = override_run_phase()
    assert during.state("run_phase", time.time() - 1) == "stopped"
    assert during.request == "phase 2, fake_score" and during.operation == "run_phase"
    assert str(during.where()).startswith("test_worker_status.py:")
    assert during.where().function == "base_run_phase"
    after = status.read_report(path.parent, 1)
    assert after.finished_unix is not None and after.dumped  # the outer watch ended it
    with rank_status.watch("sleep"):
        pass
    time.sleep(0.4)  # past the delay: a cancelled dump never comes
    fast = status.read_report(path.parent, 1)
    assert fast.operation == "sleep" and fast.request == "" and not fast.dumped  # the earlier dump is gone
    assert fast.state("run_phase", time.time()) == "idle"


def test_requests_are_described_by_what_they_ask():
    request = SimpleNamespace(phase_index=7, role=Role.STUDENT)
    assert status.describe_request("run_phase", (request, {}), {}) == "phase 7, student"
    assert status.describe_request("save_checkpoint", (12, {}), {}) == "global step 12"
    assert status.describe_request("euler", (), {"role": Role.TEACHER, "steps": 4}) == "role teacher"
    assert status.describe_request("wake", (), {}) == ""


def test_the_dump_comes_before_the_deadline_also_for_short_timeouts():
    assert status.dump_delay(20.0) == 18.0
    assert status.dump_delay(1800.0) == 1798.0
    assert abs(status.dump_delay(1.0) - 0.9) < 1e-9
    assert all(0 < status.dump_delay(t) < t for t in (0.01, 0.5, 5.0, 60.0))


def test_a_huge_timeout_still_runs_the_operation(tmp_path):
    """faulthandler cannot schedule past time_t (1e10 s): the dump is capped, the operation runs."""
    rank_status = status.RankStatus(status.status_file(status.status_dir(tmp_path), 0), rank=0, timeout=1e10)
    with rank_status.watch("sleep"):
        ran = True
    assert ran and status.read_report(status.status_dir(tmp_path), 0).operation == "sleep"


def test_a_save_stuck_in_dcp_file_io_stopped_on_its_own():
    """DCP's file writing lives under torch/distributed/checkpoint but is no collective."""
    torch_dir = "/venv/torch"
    stuck = (status.Frame(f"{torch_dir}/distributed/checkpoint/filesystem.py", 400, "_write_files_from_queue"),
             status.Frame("/src/verl_dmd/checkpoint/engine_state.py", 110, "save_engine"))  # fmt: skip
    waiting = (status.Frame(f"{torch_dir}/distributed/distributed_c10d.py", 3000, "all_gather_object"),
               status.Frame(f"{torch_dir}/distributed/checkpoint/utils.py", 280, "all_gather"))  # fmt: skip
    assert not status.in_collective(stuck, torch_dir) and status.in_collective(waiting, torch_dir)
