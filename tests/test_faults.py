"""fastdet.engine.faults and the rotating checkpoints, in-process (no training).

The end-to-end runs (a signal on one of 2 ranks, a SIGKILLed rank under torchrun
restarts, two torchrun agents as two nodes, --resume auto) are in tests/test_train.py,
where they share the reference runs.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from fastdet.runtime.checkpoint import load_with_fallback, previous_path, save_checkpoint
from fastdet.engine.faults import StopControl, config_mismatch, resume_command


def test_first_signal_asks_to_stop_a_second_ctrl_c_stops_at_once():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    ctl = StopControl(world_size=1, ckpt_interval_s=0.0, is_main=True)
    ctl.install()
    try:
        assert ctl.poll() == (False, False)
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before os.kill returns
        assert ctl.signame == "SIGTERM" and ctl.poll() == (True, False)
        os.kill(os.getpid(), signal.SIGTERM)  # a repeated TERM changes nothing
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C after a stop request: at once
    finally:
        ctl.uninstall()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_time_sized_checkpoint_is_due_after_the_interval(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("fastdet.engine.faults.time.monotonic", lambda: now[0])
    ctl = StopControl(world_size=1, ckpt_interval_s=300.0, is_main=True)
    now[0] += 299.0
    assert ctl.poll() == (False, False)
    now[0] += 2.0
    assert ctl.poll() == (False, True)
    ctl.checkpoint_saved()
    assert ctl.poll() == (False, False)


def test_a_damaged_latest_falls_back_to_the_previous_with_a_warning(tmp_path):
    latest = tmp_path / "latest.pth"
    save_checkpoint(latest, {"step": 1, "w": torch.ones(3)}, keep_previous=True)
    assert not previous_path(latest).exists()  # nothing to keep yet
    save_checkpoint(latest, {"step": 2, "w": torch.ones(3) * 2}, keep_previous=True)
    assert previous_path(latest).name == "latest.prev.pth"
    state, path = load_with_fallback(latest)
    assert state["step"] == 2 and path == latest
    data = latest.read_bytes()
    latest.write_bytes(data[: len(data) // 2])  # a kill or a full disk mid-write
    warnings: list[str] = []
    state, path = load_with_fallback(latest, warn=warnings.append)
    assert state["step"] == 1 and path == previous_path(latest)
    assert len(warnings) == 1 and "cannot be read" in warnings[0] and "latest.prev.pth" in warnings[0]
    latest.unlink()  # killed between the two renames
    assert load_with_fallback(latest)[0]["step"] == 1
    previous_path(latest).write_text("garbage")
    with pytest.raises(ValueError, match="latest.pth cannot be read .* nor can the checkpoint before it "
                                         r"\(.*latest.prev.pth is not a checkpoint"):  # both named, each its reason
        load_with_fallback(latest)


def test_config_mismatch_names_what_makes_a_checkpoint_another_runs():
    saved = {"model": {"arch": "ppyoloe", "num_classes": 4}, "optim": {"base_lr": 0.04, "milestones": [1, 2]},
             "data": {"batch_size": 8, "num_workers": 4}, "run": {"max_steps": 10}, "family": {}}
    same = {"model": {"arch": "ppyoloe", "num_classes": 80}, "optim": {"base_lr": 0.04, "milestones": (1, 2)},
            "data": {"batch_size": 8, "num_workers": 0}, "run": {"max_steps": 20}, "family": {}}
    assert config_mismatch(saved, same) == []
    other = {**same, "optim": {"base_lr": 0.01, "milestones": (1, 2)}}
    assert config_mismatch(saved, other) == ["optim.base_lr: 0.04 in the checkpoint, 0.01 now"]


def test_resume_command_repeats_the_arguments_with_resume(monkeypatch):
    for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert resume_command(["--arch", "yolox", "--output-dir", "runs/a b"]) == \
        "python -m fastdet.train --arch yolox --output-dir 'runs/a b' --resume"
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "node1")
    cmd = resume_command(["--data", "x", "--resume", "auto"])
    assert cmd.startswith("torchrun --nproc_per_node 2 --nnodes 2 --rdzv-backend c10d --rdzv-endpoint node1:")
    assert cmd.endswith("-m fastdet.train --data x --resume auto")


def _timeout_worker(rank: int, port: int, minutes: float, wait_s: float, results) -> None:
    from fastdet.runtime import dist as fdist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    info = fdist.init_distributed("cpu", timeout_minutes=minutes)
    try:
        if rank == 0:
            import time

            time.sleep(wait_s)  # rank 0 "scoring COCO" while rank 1 waits for its result
        try:
            results[rank] = fdist.broadcast_object({"AP": 0.5})
        except RuntimeError as e:
            results[rank] = "timeout" if "imed out" in str(e) or "imeout" in str(e) else str(e)[:200]
    finally:
        if rank == 1 or results.get(1) != "timeout":
            fdist.shutdown()
        assert info.world_size == 2


def test_dist_timeout_bounds_how_long_ranks_wait_for_each_other():
    """--dist-timeout reaches the collectives: rank 1 waits for rank 0's broadcast, which
    comes 5 s late; with a 2 s timeout it fails (gloo's default is 30 min, and the
    trainer's default 30 min too: what lets rank 0 score a long COCO evaluation)."""
    import torch.multiprocessing as mp
    from ports import free_port

    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    port = free_port()
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_timeout_worker, args=(port, 2 / 60, 5.0, results), nprocs=2,
                           start_method="spawn", join=True)
        assert results[1] == "timeout", dict(results)


def test_bad_dist_timeout_and_checkpoint_interval_are_one_line():
    from fastdet.config import ConfigError
    from fastdet.train import build_parser, check_config, resolve_config

    for args, msg in ((["--dist-timeout", "0"], "--dist-timeout must be positive"),
                      (["--ckpt-interval-minutes", "-1"], "--ckpt-interval-minutes must be 0 (off) or positive")):
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            check_config(resolve_config(build_parser().parse_args(args)))
