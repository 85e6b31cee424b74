"""bench/throughput.py keeps working: one tiny run of every mode through the CLI.

This is a smoke test, not a timing assertion: it checks the JSON schema, that every
mode ran (or was skipped for the reason this machine gives), that every figure is
finite and positive and consistent with the others (median within min..max, speedup
against the row of its baseline, ms/iter against images/s), and that the environment
block is there. The run uses the ``demo_small`` set, 64 px, batch 2, two windows of one
iteration, and Dynamo's ``eager`` backend for the compiled mode (tracing, guards and
graph counters as with inductor, without inductor's minutes of C++ compilation on a
CPU), and the torch reference ops (no extension build inside the budget).
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import common, throughput  # noqa: E402

HAS_DALI = importlib.util.find_spec("nvidia.dali") is not None


@pytest.fixture(scope="module")
def quick_run(demo_small, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "throughput.json"
    cmd = [sys.executable, str(REPO / "bench" / "throughput.py"), "--quick", "--device", "cpu",
           "--img-size", "64", "--windows", "2", "--iters", "1", "--warmup", "0",
           "--compile-backend", "eager", "--workers", "1", "--data", str(demo_small),
           "--cache-dir", str(tmp / "cache"),
           "--json", str(out)]
    env = {**os.environ, "FASTDET_OPS_BACKEND": "torch", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(out.read_text()), proc.stdout


def test_every_mode_ran_with_consistent_figures(quick_run):
    doc, _ = quick_run
    assert doc["schema"] == common.SCHEMA and doc["kind"] == "throughput"
    rows = {r["mode"]: r for r in doc["results"]}
    assert [r["mode"] for r in doc["results"]] == list(throughput.ALL_MODES)

    skipped = {m: r["reason"] for m, r in rows.items() if r["status"] == "skipped"}
    # --amp auto is fp32 on the CPU: eager AMP and e2e_torch would repeat other rows.
    expected_skips = {"step_eager_amp", "step_eager_amp_nhwc", "step_compile_graphs", "e2e_torch"}
    if not HAS_DALI:
        expected_skips |= {"data_dali", "e2e_dali"}
    assert set(skipped) == expected_skips, skipped
    assert "CUDA" in skipped["step_compile_graphs"]
    assert "fp32" in skipped["step_eager_amp"] and "e2e_seed" in skipped["e2e_torch"]
    if not HAS_DALI:
        assert skipped["data_dali"].startswith("unavailable: ")
    assert all(r["status"] != "failed" for r in rows.values())

    for m, r in rows.items():
        assert r["group"] == throughput.GROUP_OF[m] and r["baseline"] == throughput.BASELINE_OF[m]
        if r["status"] != "ok":
            assert r["speedup"] is None
            continue
        ips = r["images_per_s"]
        assert math.isfinite(ips) and ips > 0, m
        assert len(r["window_images_per_s"]) == 2
        assert r["min_images_per_s"] <= ips <= r["max_images_per_s"]
        assert r["spread_pct"] == pytest.approx(
            100 * (r["max_images_per_s"] - r["min_images_per_s"]) / ips)
        assert r["ms_per_iter"] == pytest.approx(1000 * 2 / ips)
        assert r["timed_s"] > 0 and r["warmup_s"] >= 0
        assert r["peak_mem_mb"] > 0 and r["mem_kind"].startswith("cpu_peak_rss")
        base = rows[r["baseline"]]
        assert r["speedup"] == pytest.approx(ips / base["images_per_s"])
        if r["group"] != "data":
            # The step ran and trained: finite losses, no recompilation after warm-up.
            assert r["losses"] and all(math.isfinite(v) for v in r["losses"].values()), m
            assert r["recompiles"] == 0 and r["graph_breaks"] == 0
            assert r["graphs"] == (1 if r["compile"] else 0), m
        if r["group"] == "e2e":
            assert 0 <= r["data_wait_frac"] <= 1
            assert r["step_only_images_per_s"] > 0
            assert r["of_step"] == pytest.approx(ips / r["step_only_images_per_s"])
        if r["group"] == "data":
            assert r["batches_per_epoch"] > 0
    assert rows["step_eager_fp32"]["speedup"] == 1.0 and rows["e2e_seed"]["speedup"] == 1.0
    assert rows["step_compile"]["dtype"] == "fp32" and rows["step_compile"]["compile"] is True
    assert rows["e2e_seed"]["step"] == "eager_fp32" and rows["e2e_seed"]["loader"] == "torch"
    # Each layout row is the same step in NHWC, its speedup over its NCHW twin of this run.
    for m, twin in (("step_eager_fp32_nhwc", "step_eager_fp32"), ("step_compile_nhwc", "step_compile")):
        assert rows[m]["baseline"] == twin and rows[m]["channels_last"] is True
        assert rows[twin]["channels_last"] is False
        assert rows[m]["compile"] == rows[twin]["compile"] and rows[m]["dtype"] == rows[twin]["dtype"]


def test_environment_and_config_block(quick_run):
    doc, stdout = quick_run
    env = doc["env"]
    dt.datetime.fromisoformat(env["date"])
    assert env["torch"] == torch.__version__ and env["device"] == "cpu" and env["gpu"] is None
    for key in ("cuda", "cudnn", "triton", "dali", "python", "cpu", "git", "tf32", "ops_backends"):
        assert key in env, key
    assert env["env_vars"]["FASTDET_OPS_BACKEND"] == "torch"
    cfg = doc["config"]
    assert (cfg["arch"], cfg["size"], cfg["img_size"], cfg["batch_size"]) == ("ppyoloe", "s", 64, 2)
    assert cfg["hw"] == [64, 64] and cfg["max_boxes"] == 16
    assert cfg["backend_flags"]["set_for"] == "cpu"
    assert cfg["amp"] == "fp32" and cfg["compile_backend"] == "eager" and cfg["quick"] is True
    assert cfg["dataset"]["images"] > 0
    # Targets are evaluated but marked as not applying to a CPU run.
    assert len(doc["targets"]) == 5 and not any(t["applies"] for t in doc["targets"])
    # The terminal table names every mode.
    for m in throughput.ALL_MODES:
        assert m in stdout


def test_mode_selection_and_bad_flags(capsys):
    assert throughput.parse_modes("e2e_dali, step") == [*throughput.GROUPS["step"], "e2e_dali"]
    assert throughput.parse_modes("all") == list(throughput.ALL_MODES)
    assert throughput.parse_modes("layout,step_eager_fp32") == ["step_eager_fp32", *throughput.GROUPS["layout"]]
    for argv, needle in ((["--modes", "step_warp"], "unknown mode 'step_warp'"),
                         (["--img-size", "100"], "multiple of 32"),
                         (["--windows", "0"], "--windows must be >= 1")):
        with pytest.raises(SystemExit) as e:
            throughput.parse_args(argv)
        assert e.value.code == 2
        assert needle in capsys.readouterr().err


@pytest.mark.parametrize("shape", [[], ["--quick"], ["--img-size", "64", "--max-boxes", "4"]])
@pytest.mark.parametrize("bad, needle", [(["--arch", "foo"], "unknown --arch 'foo'"),
                                         (["--size", "xl"], "unknown --size 'xl' for ppyoloe")])
def test_an_unknown_arch_or_size_is_a_usage_error_whatever_sets_the_shape(capsys, shape, bad, needle):
    """--quick (or an explicit --img-size and --max-boxes) needs no recipe shape, and the name
    was then first looked up when a mode built its model: a traceback after the data set-up."""
    with pytest.raises(SystemExit) as e:
        throughput.parse_args(["--device", "cpu", "--modes", "step_eager_fp32", *shape, *bad])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {needle}" in err and "Traceback" not in err


def test_modes_help_lists_every_group_it_accepts(capsys):
    with pytest.raises(SystemExit):
        throughput.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    groups = [*throughput.GROUPS, "all"]
    assert f"groups ({', '.join(groups)}); default all" in text
    for g in groups:
        assert throughput.parse_modes(g), g


def test_the_json_path_is_checked_before_any_work(tmp_path, capsys, monkeypatch):
    """A folder, a file where a folder should be, or an existing file (without --overwrite):
    one line naming --json, before measuring; before, the first two failed after measuring
    (leaving a temporary file) and the third was replaced unasked."""
    monkeypatch.setattr(throughput, "Bench", lambda args: pytest.fail("measured"))
    (tmp_path / "a_file").write_text("mine")
    kept = tmp_path / "kept.json"
    kept.write_text('{"mine": 1}')
    for path, needle in ((tmp_path, f"--json {tmp_path} is a folder"),
                         (tmp_path / "a_file" / "t.json", f"{tmp_path / 'a_file'} is a file, not a folder"),
                         (kept, f"--json {kept}: {kept} exists; add --overwrite to replace it")):
        with pytest.raises(SystemExit) as e:
            throughput.main(["--device", "cpu", "--quick", "--modes", "step_eager_fp32", "--json", str(path)])
        assert e.value.code == 2
        assert needle in capsys.readouterr().err, path
    assert kept.read_text() == '{"mine": 1}' and (tmp_path / "a_file").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "kept.json"]
    for ok in (["--json", str(kept), "--overwrite"], ["--json", str(tmp_path / "new" / "t.json")]):
        assert throughput.parse_args(["--device", "cpu", "--quick", *ok]).json == ok[1]


def test_a_failed_json_write_leaves_no_temporary_file(tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(OSError):
        common.write_json(tmp_path / "taken", {"a": 1})
    assert [p.name for p in tmp_path.iterdir()] == ["taken"] and not any((tmp_path / "taken").iterdir())


def test_e2e_torch_is_skipped_only_when_it_repeats_the_seed_step():
    def bench(*argv):
        return throughput.Bench(throughput.parse_args(["--device", "cpu", *argv]))

    b = bench()
    assert b.repeats_seed_step(b.variant("eager_fp32"))
    assert b.repeats_seed_step(b.variant("eager_amp"))  # --amp auto is fp32 on the CPU
    assert not b.repeats_seed_step(b.variant("compile"))
    assert not b.repeats_seed_step(b.variant("eager_fp32_nhwc"))  # another layout than e2e_seed's
    assert not bench("--amp", "bf16").repeats_seed_step(b.variant("eager_amp"))
    nhwc = bench("--channels-last")  # e2e_seed is NHWC too: the same step again
    assert nhwc.repeats_seed_step(nhwc.variant("eager_fp32_nhwc"))


def test_summary_table_and_result_name():
    s = common.summarize([4.0, 1.0, 10.0, 2.0])
    assert (s["median"], s["min"], s["max"]) == (3.0, 1.0, 10.0)
    assert s["spread_pct"] == pytest.approx(300.0)
    text = common.format_table([{"a": "x", "b": 1.23456}, {"a": "longer", "b": None}],
                               [("a", "name", ""), ("b", "value", ".2f")])
    lines = text.splitlines()
    assert lines[0].split() == ["name", "value"] and lines[2].split() == ["x", "1.23"]
    assert lines[3].split() == ["longer", "-"]
    env = {"date": "2026-12-02T10:00:00+00:00", "torch": "2.11.0+cu130",
           "gpu": {"name": "NVIDIA H200"}, "cpu": {"model": "x"}}
    assert common.result_stem(env, "throughput step") == \
        "2026-12-02_nvidia-h200_torch-2.11.0-cu130_throughput-step"


def test_peak_memory_sees_an_allocation():
    with common.PeakMemory(torch.device("cpu")) as before:
        pass
    with common.PeakMemory(torch.device("cpu")) as mem:
        x = torch.ones(64 * 2**20)  # 256 MiB, written so the pages are resident
        del x
    assert mem.mb >= 256 and (mem.kind != "cpu_peak_rss" or mem.mb >= before.mb)


def test_cpu_run_checks_no_h200_target_and_records_the_load(quick_run):
    doc, stdout = quick_run
    assert all(t["met"] is None and t["verdict"].startswith(("not checked", "not measured")) for t in doc["targets"])
    assert "MISSED" not in stdout and "targets not checked" in stdout
    for when in ("start", "end"):
        load = doc["machine_load"][when]
        assert load["cpus"] == os.cpu_count() and len(load["loadavg_1_5_15"]) == 3
    for r in doc["results"]:
        if r["status"] == "ok":
            assert r["reliable"] == (r["spread_pct"] <= throughput.UNRELIABLE_SPREAD_PCT)


def test_noise_is_not_met_and_a_wide_spread_is_flagged():
    v = throughput.verdict
    assert v(1.6, 1.5, 2.0, True) == {"met": True, "verdict": "met"}
    assert v(1.4, 1.5, 2.0, True)["verdict"] == "MISSED"
    assert v(1.6, 1.5, 70.0, True)["met"] is None and "within noise" in v(1.6, 1.5, 70.0, True)["verdict"]
    assert v(9.0, 1.5, 1.0, False)["met"] is None
    assert throughput.reliability({"status": "ok", "spread_pct": 70.0}).startswith("UNRELIABLE: spread 70%")
    assert throughput.reliability({"status": "ok", "spread_pct": 3.0}) == ""


# --------------------------------------------------------------------------- bench/dali_check.py

def test_dali_check_watches_the_whole_process_tree():
    """A row's peaks cover its worker processes: a parent holding 60 MB whose child holds
    another 60 MB reads as at least 100 MB over 2 processes."""
    import time

    from bench import dali_check

    code = ("import os, time, numpy as np; a = np.ones(60 * 2**20 // 8); pid = os.fork()\n"
            "b = np.ones(60 * 2**20 // 8) if pid == 0 else None; time.sleep(1.5)\n"
            "os._exit(0) if pid == 0 else os.waitpid(pid, 0)")
    proc = subprocess.Popen([sys.executable, "-c", code])
    mon = dali_check.TreeMonitor(proc.pid, period=0.05)
    proc.wait()
    time.sleep(0.1)
    peaks = mon.stop()
    assert peaks["peak_processes"] >= 2 and peaks["peak_host_pss_mb"] >= 100, peaks


def test_dali_check_summary_takes_medians_and_ratios():
    from bench import dali_check

    rows = [{"family": "yolox", "label": lab, "images_per_s": v, "peak_host_pss_mb": m, "peak_host_threads": 4}
            for lab, v, m in (("torch", 10.0, 900), ("dali", 30.0, 500), ("dali@before", 20.0, 800),
                              ("torch", 12.0, 950), ("dali", 24.0, 520), ("dali@before", 16.0, 780),
                              ("dali", 27.0, 510))]
    rows.append({"family": "yolox", "label": "torch", "error": "exit 1"})
    s = dali_check._summary(rows, ["yolox"])["yolox"]
    assert s["dali"]["images_per_s"] == 27.0 and s["dali"]["repeats"] == [30.0, 24.0, 27.0]
    assert s["torch"]["images_per_s"] == 11.0 and s["dali@before"]["peak_host_pss_mb"] == 790
    assert s["ratios"] == pytest.approx({"dali_over_torch": 27 / 11, "dali_over_dali@before": 27 / 18})

def test_dali_check_keeps_the_decode_check_and_each_row_of_a_run_cut_short(tmp_path, monkeypatch):
    """bench/gpu_check_dali.sh cuts the check at its part's limit (150 s for 8 rows, a
    process each, beside the precompile lane): the decode check (nvJPEG against the CPU
    decoder) runs first, and the JSON is rewritten after it and after every row, so a cut
    keeps both; the rows' logs lie beside the JSON, which the call brings back. Before, the
    decode check ran last and nothing was written until the end."""
    from bench import dali_check

    calls = []

    def spawn(spec, log_dir, timeout):
        calls.append(spec["what"])
        if spec["what"] == "decode":
            return {"label": "decode", "decoder": "stand-in", "ok": True, "failed": []}
        if len(calls) == 3:
            raise KeyboardInterrupt  # the part's limit, during the second row
        return {"label": spec["label"], "images_per_s": 10.0, "spread_pct": 1.0, "peak_host_pss_mb": 1.0,
                "peak_host_threads": 1}

    monkeypatch.setattr(dali_check, "_spawn", spawn)
    out = tmp_path / "x_dali-check.json"
    with pytest.raises(KeyboardInterrupt):
        dali_check.main(["--device", "cpu", "--families", "ppyoloe", "yolox", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert calls == ["decode", "row", "row"]
    assert doc["decode_check"]["ok"] and [(r["family"], r["label"]) for r in doc["rows"]] == [("ppyoloe", "torch")]
    assert doc["summary"]["ppyoloe"]["torch"]["images_per_s"] == 10.0 and doc["env"]["device"] == "cpu"
    assert (tmp_path / "x_dali-check-logs").is_dir()


def test_decode_check_passes_another_chroma_upsampling_and_fails_a_corrupted_block():
    """nvJPEG (DALI's mixed decoder) rebuilds 4:2:0 chroma by repeating it, the CPU decoder
    by libjpeg-turbo's fancy upsampling: on an image of colour edges that moves RGB by 7
    levels on average (the RGB criterion failed it: a corrupted-decode alarm on a healthy
    GPU) and luma by about half a level. A block of the image decoded wrong still fails."""
    import io

    import numpy as np
    from PIL import Image

    from bench.dali_check import compare_decodes

    rng = np.random.default_rng(0)
    image = np.kron(rng.integers(0, 256, (40, 40, 3)), np.ones((8, 8, 1))).astype(np.uint8)  # 320 x 320
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, "JPEG", quality=90, subsampling=2)
    ref = np.asarray(Image.open(buf).convert("RGB"))  # PIL: libjpeg's fancy upsampling
    ycc = np.asarray(Image.fromarray(ref).convert("YCbCr")).astype(np.float64)
    y = ycc[..., 0]
    cb, cr = (np.kron(ycc[..., c].reshape(160, 2, 160, 2).mean((1, 3)), np.ones((2, 2))) - 128 for c in (1, 2))
    repeated = np.clip(np.rint(np.stack([y + 1.402 * cr, y - 0.344136 * cb - 0.714136 * cr, y + 1.772 * cb], -1)),
                       0, 255).astype(np.uint8)
    r = compare_decodes(repeated, ref)
    assert r["ok"] and r["mean_abs_rgb"] > 2.0 and r["mean_abs_luma"] < 1.0, r
    broken = ref.copy()
    broken[64:128, 64:192] = ref[64:128, 0:128][:, ::-1]  # 8 % of the image from the wrong place
    assert not compare_decodes(broken, ref)["ok"]
    assert not compare_decodes(ref[:, :-8], ref)["ok"]


def test_each_family_is_benched_at_its_published_shape_and_box_padding():
    """Without --quick, --img-size and --max-boxes are the recipe's: FCOS's keep-ratio
    canvas 800x1344 (not a square), YOLOX's 120 boxes, PP-YOLO's 608 px and 50 boxes."""
    def shape(*argv):
        a = throughput.parse_args(["--device", "cpu", *argv])
        return a.img_size, a.max_boxes

    assert shape() == ((640, 640), 100)
    assert shape("--arch", "yolox", "--size", "s") == ((640, 640), 120)
    assert shape("--arch", "ppyolo", "--size", "r50vd_dcn") == ((608, 608), 50)
    assert shape("--arch", "fcos", "--size", "r50") == ((800, 1344), 100)
    assert shape("--arch", "fcos", "--size", "r50", "--img-size", "1344x800", "--max-boxes", "7") == ((1344, 800), 7)
    assert shape("--quick") == ((128, 128), 16)
    for bad in ("64x100", "8x8x8", "wide"):
        with pytest.raises(SystemExit):
            throughput.parse_args(["--device", "cpu", "--img-size", bad])


def test_a_non_square_step_runs_at_its_height_and_width(tmp_path):
    b = throughput.Bench(throughput.parse_args(
        ["--device", "cpu", "--quick", "--img-size", "64x96", "--windows", "1", "--iters", "1", "--warmup", "0",
         "--modes", "step_eager_fp32", "--cache-dir", str(tmp_path)]))
    v = b.variant("eager_fp32")
    assert b.synthetic(v, n=1)[0]["images"].shape == (2, 3, 64, 96)
    row = b.run_mode("step_eager_fp32")
    assert row["status"] == "ok" and row["images_per_s"] > 0, row


def test_benchmarks_set_cudnn_and_tf32_as_the_trainer_does(monkeypatch):
    """One function sets the flags for the trainer, its compile workers and the benchmarks
    (so "eager fp32" is the trainer's fp32), and the benchmark records them."""
    import fastdet.runtime.amp as amp_mod
    from fastdet.engine import compile_workers, trainer

    calls = []
    real = amp_mod.backend_flags
    monkeypatch.setattr(amp_mod, "backend_flags", lambda d, tf32: calls.append((d.type, tf32)) or real(d, tf32))
    b = throughput.Bench(throughput.parse_args(["--device", "cpu", "--quick"]))
    assert calls == [("cpu", False)] and b.backend_flags == real(torch.device("cpu"), False)
    assert b.document()["config"]["backend_flags"] == b.backend_flags
    assert trainer.backend_flags is real and compile_workers.backend_flags is real
    assert "backend_flags(dev, cfg.compile.tf32)" in Path(compile_workers.__file__).read_text()
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32
    try:
        for tf32 in (False, True):
            flags = real(torch.device("cuda"), tf32)  # setting the flags needs no GPU
            assert flags == {"set_for": "cuda", "cudnn_benchmark": True, "tf32_cudnn": tf32, "tf32_matmul": tf32}
            assert (cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32) == (True, tf32, tf32)
    finally:
        cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32 = saved


@pytest.mark.slow
def test_precompile_fills_the_cache_that_the_timed_mode_then_loads(tmp_path):
    """bench/gpu_check.sh compiles the timed parts' graphs first, in parallel processes
    (--precompile): the timed mode must then hit inductor's cache, not compile again."""
    env = {**os.environ, "FASTDET_OPS_BACKEND": "torch", "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    cmd = [sys.executable, str(REPO / "bench" / "throughput.py"), "--quick", "--device", "cpu", "--img-size", "64",
           "--windows", "1", "--iters", "1", "--warmup", "0", "--modes", "step_compile",
           "--cache-dir", str(tmp_path / "cache")]
    docs = []
    for extra, name in ((["--precompile"], "pre.json"), ([], "timed.json")):
        r = subprocess.run([*cmd, *extra, "--json", str(tmp_path / name)], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=3600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        docs.append(json.loads((tmp_path / name).read_text()))
    (pre,), (timed,) = docs[0]["results"], docs[1]["results"]
    assert pre["status"] == "ok" and pre["inductor_cache"]["fx_miss"] > 0
    assert timed["mode"] == "step_compile" and timed["status"] == "ok"
    assert timed["inductor_cache"]["fx_miss"] == 0 and timed["inductor_cache"]["fx_hit"] > 0, timed["inductor_cache"]
