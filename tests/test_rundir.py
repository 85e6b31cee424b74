"""The output directory a new run writes to (fastdet/engine/rundir.py): never one another
start has chosen, even when two starts of one command look at the same moment."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

from fastdet.engine import rundir


def _claim(path: str, barrier, results) -> None:
    barrier.wait()  # every start looks at the same moment
    results.put(str(rundir.claim_run_dir(Path(path))[0]))


def test_starts_that_look_together_each_claim_their_own_directory(tmp_path):
    """Eight starts of one command at once (a sweep launched by a script, a job array):
    ``runs/x`` holds a run, and each start must get a directory of its own. Choosing the
    first free one and then making it let several choose ``x2`` and write into it."""
    asked = tmp_path / "x"
    asked.mkdir()
    (asked / "latest.pth").write_bytes(b"a run")
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(8), ctx.Queue()
    procs = [ctx.Process(target=_claim, args=(str(asked), barrier, results)) for _ in range(8)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got == sorted(str(tmp_path / f"x{n}") for n in range(2, 10))
    assert (asked / "latest.pth").read_bytes() == b"a run" and not (asked / "train.log").exists()


def test_a_directory_claimed_between_the_look_and_the_claim_is_left_to_its_run(tmp_path, monkeypatch):
    """The race made certain: another start claims ``x2`` after this one found it free;
    this one takes ``x3``, and says it made it (a failed start then removes it)."""
    asked = tmp_path / "x"
    asked.mkdir()
    (asked / "metrics.jsonl").write_text("{}\n")
    look = rundir.free_run_dir

    def look_then_lose(path: Path) -> Path:
        chosen = look(path)
        if chosen.name == "x2":
            chosen.mkdir()
            (chosen / "train.log").write_text("the other start\n")
        return chosen

    monkeypatch.setattr(rundir, "free_run_dir", look_then_lose)
    out, made = rundir.claim_run_dir(asked)
    assert (out, made) == (tmp_path / "x3", True)
    assert (tmp_path / "x2" / "train.log").read_text() == "the other start\n"
    assert (out / "train.log").read_text() == ""


def test_an_empty_folder_is_claimed_as_it_is_and_a_file_of_the_name_is_passed_over(tmp_path):
    """A folder the user made for the run is used (not made by this start: a failed start
    leaves it); a file named like the next candidate is not a directory to write into."""
    asked = tmp_path / "exp"
    asked.mkdir()
    assert rundir.claim_run_dir(asked) == (asked, False)
    (tmp_path / "exp2").write_text("notes")
    assert rundir.claim_run_dir(asked) == (tmp_path / "exp3", True)
    assert (tmp_path / "exp2").read_text() == "notes"


def test_a_new_run_over_another_falls_back_on_none_of_its_checkpoints(tmp_path):
    """--exist-ok over another run: the first latest.pth this run writes must not make the
    other run's latest.pth its latest.prev.pth (the checkpoint a damaged latest.pth resumes
    from, config permitting); from its second save on, and in a resumed run, the one before
    is kept as before."""
    from types import SimpleNamespace

    import torch

    from fastdet import registry
    from fastdet.config import apply_overrides
    from fastdet.engine.checkpointer import Checkpointer
    from fastdet.runtime.checkpoint import load_checkpoint, save_checkpoint

    for name, step in (("latest.prev.pth", 20), ("latest.pth", 30)):
        save_checkpoint(tmp_path / name, {"step": step, "config": {}})
    model = torch.nn.Linear(2, 2)

    def checkpointer(resume: bool) -> Checkpointer:
        cfg = apply_overrides(registry.get_preset("ppyoloe", "s"), {"run.resume": resume})
        return Checkpointer(cfg, tmp_path, SimpleNamespace(world_size=1, is_main=True), model, None,
                            torch.optim.SGD(model.parameters(), lr=0.1),
                            SimpleNamespace(cat_ids=[1], class_names=["a"]), 5)

    def steps() -> tuple[int, int | None]:
        prev = tmp_path / "latest.prev.pth"
        return (load_checkpoint(tmp_path / "latest.pth")["step"],
                load_checkpoint(prev)["step"] if prev.exists() else None)

    new = checkpointer(resume=False)
    new.save_latest(0, 1, 0.0)
    assert steps() == (1, None)
    new.save_latest(0, 2, 0.0)
    assert steps() == (2, 1)
    checkpointer(resume=True).save_latest(0, 3, 0.0)
    assert steps() == (3, 2)


def test_a_dangling_link_named_train_log_takes_the_directory(tmp_path):
    """A ``train.log`` that is a link to nothing: the directory is taken (before, it looked
    free, the exclusive create failed on the link, and the claim chose it again forever)."""
    asked = tmp_path / "x"
    asked.mkdir()
    (asked / "train.log").symlink_to(tmp_path / "nowhere")
    assert rundir.claim_run_dir(asked) == (tmp_path / "x2", True)


def test_a_restart_finds_the_directory_its_launch_claimed(tmp_path, monkeypatch):
    """Under torchrun the first start of a launch marks the directory it claims; a restart
    of that launch (same agent, same rendezvous id) finds it among the asked directory and
    its numbered siblings, another launch does not."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    asked = tmp_path / "exp"
    asked.mkdir()
    (asked / "latest.pth").write_bytes(b"another run")
    (tmp_path / "exp2").mkdir()  # a run of another launch
    (tmp_path / "exp2" / "train.log").write_text("another launch\n")
    rundir.mark_launch(tmp_path / "exp2", "otherhost 1 job7")
    (tmp_path / "expected").mkdir()  # not a numbered sibling
    out, _ = rundir.claim_run_dir(asked)
    rundir.mark_launch(out, rundir.launch_key())
    assert out == tmp_path / "exp3"
    assert rundir.launch_dir(asked, rundir.launch_key()) == out
    assert rundir.launch_dir(tmp_path / "exp2", rundir.launch_key()) == out  # asked as a numbered name
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job8")
    assert rundir.launch_dir(asked, rundir.launch_key()) is None
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert rundir.launch_key() is None and rundir.launch_dir(asked, None) is None
