"""The CLI's shared pieces (mgpu.commands.common) in one process: list options refuse empty
items, signs, overflow and (for sweeps) duplicates; an error line is one write; the
`mgpu info` summary."""

import argparse
import copy
import json
import os
import re
from pathlib import Path

import pytest

import mgpu
from mgpu.commands import info as info_command
from mgpu.commands import main as cli
from mgpu.commands.common import INT32_MAX, float_list, int_list
from mgpu.selector import tuning

PACKAGE = Path(mgpu.__file__).parent


@pytest.mark.parametrize(
    "text, message",
    [
        ("50,,3", "empty value"),
        ("50,3,", "empty value"),
        (",50,3", "empty value"),
        ("", "got nothing"),
        ("50,abc,3", "'abc' is not an integer"),
        ("50,2.5,3", "not an integer"),
        ("50,-3,3", ">= 1, got -3"),
        ("50,0,3", ">= 1, got 0"),
        ("50,+3,3", "plain digits"),
        ("50,1_000,3", "plain digits"),
        (f"50,{INT32_MAX + 1},3", f"at most {INT32_MAX}"),
        ("50," + "9" * 30 + ",3", f"at most {INT32_MAX}"),
    ],
)
def test_int_list_refuses_what_the_core_cannot_take(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        int_list("layer sizes")(text)


def test_int_list_takes_plain_positive_integers():
    assert int_list("layer sizes")(f" 50, 256,256 ,{INT32_MAX}") == [50, 256, 256, INT32_MAX]
    with pytest.raises(argparse.ArgumentTypeError, match="distinct: 2 appears 2 times"):
        int_list("rank counts", distinct=True)("1,2,2")
    assert int_list("rank counts", distinct=True)("4,1,2") == [4, 1, 2]


@pytest.mark.parametrize(
    "text, message",
    [
        ("0.5,,0.5", "empty value"),
        ("0.5,", "empty value"),
        ("-1,2", ">= 0"),
        ("nan,1", "finite"),
        ("inf,1", "finite"),
        ("1e400,1", "finite"),
        ("a,1", "not a number"),
    ],
)
def test_float_list_refuses_empty_negative_and_non_finite(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        float_list("batch shares")(text)


@pytest.mark.parametrize(
    "argv, option",
    [
        (["train", "--layers", "50,,3"], "--layers"),
        (["train", "--batch-shares", "0.7,,0.3"], "--batch-shares"),
        (["bench", "--layers", "4,0,4"], "--layers"),
        (["bench", "--batch-sizes", "64,64"], "--batch-sizes"),
        (["bench", "--ranks", "2,2"], "--ranks"),
        (["bench", "--ranks", f"1,{INT32_MAX + 1}"], "--ranks"),
        (["recommend", "--model", "large", "--batch-size", "8", "--devices", "1,1"], "--devices"),
        (["recommend", "--layers", f"50,{2**40},3", "--batch-size", "8"], "--layers"),
    ],
)
def test_every_list_option_is_checked_by_the_parser(argv, option):
    with pytest.raises(cli.UsageError, match=f"argument {option}: "):
        cli.build_parser().parse_args(argv)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--ranks", "100000", "--model", "medium"], "bench launches every rank on this machine, at most"),
        (["bench", "--ranks", "1,8", "--batch-sizes", "4", "--model", "medium"], "batch 4 is smaller than 8 ranks"),
        (
            ["recommend", "--model", "large", "--batch-size", "8", "--profile", "h100-ib-2x8", "--nodes", "1025"],
            "--nodes must be at most 1024",
        ),
        (["bench", "--model", "medium", "--batch-sizes", "2000000000", "--no-progress"], "rows a rank needs about"),
        # flags that were silently ignored: topo measured with the default threads, or saved nowhere
        (["topo", "--threads", "0"], "--threads must be >= 1, got 0"),
        (["topo", "--no-save", "--out", "profile.json"], "--no-save saves none"),
        (["topo", "--no-save", "--out", ""], "--no-save saves none"),
        # an empty --profile was taken as auto
        (["recommend", "--model", "medium", "--batch-size", "64", "--profile", ""], "--profile is empty"),
        (["bench", "--validate-selector", "--model", "medium", "--profile", " "], "--profile is empty"),
    ],
)
def test_counts_beyond_what_can_run_are_refused_before_anything_starts(argv, message, capfd):
    assert cli.main(argv) == 2  # an mpirun of 100000 ranks would not come back
    err = capfd.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--model", "medium", "--steps", "1", "--tensorboard", ""],
        ["bench", "--model", "medium", "--plots", ""],
        ["topo", "--plots", ""],
        ["topo", "--out", ""],  # it saved the machine's calibration in the default place
    ],
)
def test_an_empty_output_directory_is_refused_not_ignored(argv, capfd):
    assert cli.main(argv) == 2
    err = capfd.readouterr().err
    assert f"{argv[-2]}: the path is empty" in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "argv",
    [
        # shares near the float limit: the rows come from split_counts, which normalises them
        ["train", "--layers", "20,64,3", "--steps", "1", "--batch-shares", "1e308", "--no-progress"],
        # a batch larger than the dataset takes the dataset's rows, not the batch's
        [
            "train",
            "--dataset",
            "digits",
            "--layers",
            "64,1000,10",
            "--batch-size",
            "100000000",
            "--steps",
            "1",
            "--no-progress",
        ],
    ],
)
def test_the_memory_check_counts_the_rows_a_rank_really_takes(argv, capfd):
    assert cli.main(argv) == 0, capfd.readouterr().err


def test_a_list_value_that_starts_with_a_minus_says_how_to_pass_it():
    # argparse reads "-1,2" as an option, not as --batch-shares' value: the error says
    # so and how to pass it, and that form reaches the list check.
    with pytest.raises(
        cli.UsageError,
        match=r"expected one argument \(a value starting with '-' reads as an "
        r"option: write --batch-shares=VALUE\)",
    ):
        cli.build_parser().parse_args(["train", "--batch-shares", "-1,2"])
    with pytest.raises(cli.UsageError, match="argument --batch-shares: .*"):
        cli.build_parser().parse_args(["train", "--batch-shares=-1,2"])


def test_an_error_is_one_write_with_its_newline(monkeypatch, capfd):
    """Ranks failing together must not glue their lines: each line leaves in one write."""
    writes = []
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: writes.append((fd, data)) or real(fd, data))
    assert cli.main(["train", "--layers", "50,,3"]) == 2
    assert [(data.count(b"\n"), data.endswith(b"\n")) for _, data in writes] == [(1, True)]
    assert b"empty value" in writes[0][1]
    assert capfd.readouterr().err.count("\n") == 1


def test_an_error_line_starts_after_an_open_progress_bar(capfd):
    import sys

    from tqdm.auto import tqdm

    from mgpu.console import write_line

    bar = tqdm(total=4, desc="bench", file=sys.stderr)
    bar.update(1)
    write_line("mgpu: error: something")
    assert "\nmgpu: error: something\n" in capfd.readouterr().err


def test_blas_kernel_from_the_openblas_config():
    assert info_command._blas_kernel("OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH NO_AFFINITY Zen MAX_THREADS=64") == "Zen"
    assert info_command._blas_kernel("OpenBLAS 0.3.26 USE_OPENMP HASWELL SINGLE_THREADED") == "HASWELL"
    assert info_command._blas_kernel("OpenBLAS 0.3.26 DYNAMIC_ARCH NO_AFFINITY MAX_THREADS=8") == ""
    assert info_command._blas_kernel("") == ""


def _info(**cuda):
    info = copy.deepcopy(mgpu.build_info())
    info["process"] = {"rank": 0, "size": 2, "local_rank": 0, "local_size": 2}
    info["cuda"].update(cuda)
    return info


def test_info_summary_names_each_component():
    text = info_command.format_info(_info())
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    heads = [line.split(":")[0] for line in text.splitlines() if not line.startswith(" ")]
    for head in ("BLAS", "MPI", "CUDA", "NCCL", "GPUs", "backends", "process"):
        assert head in heads, text
    assert mgpu.__version__ in text and "rank 0 of 2" in text and "--json" in text


def test_info_summary_without_cuda_and_with_mismatched_libraries():
    no_cuda = _info(
        compiled=False, backend=False, nccl_communicator=False, devices=[], device_count=0, nccl_found=False
    )
    text = info_command.format_info(no_cuda)
    assert "CUDA:     not built in" in text and "NCCL:     not built in" in text and "no CUDA backend" in text
    mixed = _info(
        compiled=True,
        runtime_compiled="12.4",
        runtime_loaded="12.8",
        nccl_communicator=True,
        nccl_compiled="2.21.5",
        nccl_loaded="2.26.2",
        devices=[],
        no_device_reason="no driver",
    )
    text = info_command.format_info(mixed)
    assert "12.8 (built with 12.4)" in text and "2.26.2 (built with 2.21.5)" in text
    assert "none visible: no driver" in text


def test_info_summary_says_when_gpus_are_emulated():
    gpu = {
        "index": 0,
        "name": "Emulated GPU 0",
        "total_memory_mib": 2048,
        "multiprocessors": 132,
        "compute_capability": "9.0",
        "pci_bus_id": "0000:E0:00.0",
    }
    info = _info(compiled=True, devices=[gpu], device_count=1, nccl_communicator=True)
    info["gpu_emulation"] = True
    text = info_command.format_info(info)
    assert text.startswith("GPU EMULATION") and "1 EMULATED GPU(s)" in text
    assert all("EMULATED" in line for line in text.splitlines() if line.startswith(("CUDA:", "NCCL:")))
    info["gpu_emulation"] = False
    assert "EMULAT" not in info_command.format_info(info)


def test_auto_bucket_and_shares_need_a_calibration_of_the_jobs_devices(tmp_path, monkeypatch):
    # A CPU calibration (MPI over shared memory) says nothing of NCCL on GPUs: `train
    # --device cuda` takes the safe 4 MB and says why instead of a bucket priced for
    # CPU ranks, and --batch-shares auto refuses; on CPU ranks the calibration serves.
    from types import SimpleNamespace

    from mgpu.selector import profiles as perf

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    perf.save_profile(perf.named_profile("cpu", 2))
    cfg = mgpu.TrainConfig(layers=[50, 64, 3], batch_size=64, optimizer="sgd")
    pg, sizes = SimpleNamespace(size=2), [50, 64, 3]
    mb, note = tuning.auto_bucket_mb(cfg, pg, sizes, "cuda")
    assert mb == 4.0 and "the calibration measured cpu devices, this job runs on cuda" in note
    assert "mgpu topo --device cuda" in note
    mb, note = tuning.auto_bucket_mb(cfg, pg, sizes, "cpu")
    assert "(auto)" in note and "measured cpu devices" not in note
    with pytest.raises(mgpu.ConfigError, match="--batch-shares auto: the calibration measured cpu devices"):
        tuning.auto_batch_shares(cfg, pg, sizes, "cuda")
    assert len(tuning.auto_batch_shares(cfg, pg, sizes, "cpu")) == 2


def test_a_batch_beyond_the_dataset_says_every_step_takes_the_dataset(tmp_path, capfd):
    out = tmp_path / "r.json"
    assert (
        cli.main(
            [
                "train",
                "--layers",
                "50,16,3",
                "--steps",
                "1",
                "--batch-size",
                "32",
                "--accumulate",
                "1000",
                "--no-progress",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    header = capfd.readouterr().out.splitlines()[0]
    assert "x 1000 accumulated (larger than the 8000 training samples: every step takes all 8000" in header, header
    assert "global batch 32 (8000 per rank a step)" in header, header  # the whole dataset, not 32
    config = json.loads(out.read_text())["config"]
    assert config["samples_per_step"] == 8000 and config["effective_batch"] == 32000


def test_the_header_splits_the_rows_a_step_takes_when_the_batch_exceeds_the_dataset(tmp_path, capfd):
    assert cli.main(["train", "--layers", "50,16,3", "--steps", "1", "--batch-size", "20000", "--no-progress"]) == 0
    header = capfd.readouterr().out.splitlines()[0]
    assert "global batch 20000 (8000 per rank a step) (larger than the 8000 training samples" in header, header


def test_list_profiles_writes_the_list_as_json_too(tmp_path, capfd):
    from mgpu.selector import profiles as perf

    out = tmp_path / "profiles.json"
    assert cli.main(["recommend", "--list-profiles", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert list(doc["profiles"]) == list(perf.NAMED_PROFILES) and doc["aliases"] == perf.PROFILE_ALIASES
    assert all(s["url"].startswith("http") for p in doc["profiles"].values() for s in p["sources"])
    assert "h100-sxm-8" in capfd.readouterr().out


def test_outputs_may_not_be_empty_special_shared_or_an_input(tmp_path):
    from mgpu.commands.common import check_outputs

    data = tmp_path / "data.npz"
    data.write_bytes(b"x")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    check_outputs({"--json": str(tmp_path / "a.json"), "--csv": None}, {"--dataset": str(data)})
    for outputs, inputs, message in [
        ({"--json": ""}, {}, "--json: the path is empty"),
        ({"--json": str(fifo)}, {}, "is not a regular file"),
        ({"--json": str(tmp_path / "a"), "--csv": str(tmp_path / "a")}, {}, "--json and --csv name the same file"),
        ({"--save": str(data)}, {"--dataset": str(data)}, "--save .* is the --dataset this run reads"),
    ]:
        with pytest.raises(mgpu.ConfigError, match=message):
            check_outputs(outputs, inputs)


@pytest.mark.parametrize(
    "argv, kept, message",
    [
        (
            ["recommend", "--model", "medium", "--batch-size", "64", "--json"],
            "profile.json",
            "--json .* is this machine's calibration",
        ),
        (
            ["recommend", "--model", "medium", "--batch-size", "64", "--json"],
            "checks.jsonl",
            "--json .* is the record of checks beside this machine's",
        ),
        (
            ["bench", "--model", "medium", "--batch-sizes", "64", "--ranks", "1", "--csv"],
            "checks.jsonl",
            "--csv .* is the record of checks",
        ),
        (["train", "--model", "medium", "--save"], "checks.jsonl", "--save .* is the record of checks"),
        (["train", "--model", "medium", "--json"], "profile.json", "--json .* is this machine's calibration"),
        (["stress", "--device", "cpu", "--json"], "profile.json", "--json .* is this machine's calibration"),
        (["topo", "--no-save", "--json"], "profile.json", "--json .* is this machine's calibration"),
        (["topo", "--json"], "profile.json", "the calibration this run saves and --json name the same file"),
        (["topo", "--out"], "checks.jsonl", "--out .* is the record of checks beside this machine's calibration"),
    ],
)
def test_no_output_may_name_the_calibration_or_its_record(tmp_path, monkeypatch, capfd, argv, kept, message):
    """The calibration train, bench and recommend read (and its record, which they append
    to) is no output's to overwrite, existing or not; topo's own save neither."""
    from mgpu.selector.profiles import default_profile_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cache = os.path.dirname(default_profile_path())
    os.makedirs(cache)
    (tmp_path / "cache" / "mgpu" / "profile.json").write_text("kept")
    target = os.path.join(cache, kept)
    assert cli.main(argv + [target]) == 2
    err = capfd.readouterr().err
    assert re.search(message, err) and err.count("\n") == 1, err
    assert (tmp_path / "cache" / "mgpu" / "profile.json").read_text() == "kept"
    assert kept == "profile.json" or not os.path.exists(target)


def test_a_profile_file_and_its_record_are_kept_too(tmp_path):
    from mgpu.commands.common import check_outputs

    profile = tmp_path / "other" / "p.json"
    profile.parent.mkdir()
    profile.write_text("{}")
    check_outputs({"--json": str(tmp_path / "other" / "out.json")}, {"--profile": str(profile)}, profile=str(profile))
    with pytest.raises(mgpu.ConfigError, match="--json .* is the record of checks beside the --profile"):
        check_outputs(
            {"--json": str(profile.parent / "checks.jsonl")}, {"--profile": str(profile)}, profile=str(profile)
        )
    with pytest.raises(mgpu.ConfigError, match="--csv .* is the --profile this run reads"):
        check_outputs({"--csv": str(profile)}, {"--profile": str(profile)}, profile=str(profile))


@pytest.mark.parametrize("option", ["--out", "--json"])
@pytest.mark.parametrize("plot", ["gemm.png", "allreduce.png"])
def test_topo_refuses_an_output_that_is_one_of_its_plots(tmp_path, option, plot, capfd):
    plots = tmp_path / "plots"
    plots.mkdir()
    (plots / plot).write_text("kept")
    assert cli.main(["topo", "--plots", str(plots), option, str(plots / plot)]) == 2
    err = capfd.readouterr().err
    assert f"{option} and --plots {plot} name the same file" in err and err.count("\n") == 1, err
    assert (plots / plot).read_text() == "kept"


def test_outputs_may_not_be_or_shadow_what_the_run_keeps_in_its_directories(tmp_path):
    from mgpu.commands.common import check_outputs_outside_dirs
    from mgpu.train.checkpoint import CHECKPOINT_NAME

    ckpt, board = tmp_path / "ckpt", tmp_path / "board"
    dirs, reserved = {"--checkpoint-dir": str(ckpt), "--tensorboard": str(board)}, {"--checkpoint-dir": CHECKPOINT_NAME}
    check_outputs_outside_dirs(
        {"--json": str(ckpt / "results.json"), "--save": str(tmp_path / "ckpt-000000001.npz")}, dirs, reserved
    )  # beside the checkpoints, or so named elsewhere: fine
    for outputs, message in [
        ({"--json": str(ckpt)}, "--json .* is the directory --checkpoint-dir writes into"),
        ({"--save": str(board)}, "--save .* is the directory --tensorboard writes into"),
        ({"--save": str(ckpt / "ckpt-000000002.npz")}, "named like the files --checkpoint-dir keeps"),
    ]:
        with pytest.raises(mgpu.ConfigError, match=message):
            check_outputs_outside_dirs(outputs, dirs, reserved)


def test_an_output_is_refused_where_no_file_can_be_created():
    # os.access answers yes for root in /sys; creating a file there fails (after the work)
    from mgpu.commands.common import check_output_dir, check_outputs

    with pytest.raises(mgpu.ConfigError, match="'/sys' is not writable"):
        check_outputs({"--json": "/sys/results.json"})
    with pytest.raises(mgpu.ConfigError, match="'/sys' is not writable"):
        check_output_dir("/sys/plots", "--plots")


def test_a_failed_json_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    from mgpu.atomic import write_json_atomic

    target = tmp_path / "a.json"
    write_json_atomic(str(target), {"kept": 1})
    with pytest.raises(TypeError):
        write_json_atomic(str(target), {"unserialisable": object()})
    with pytest.raises(IsADirectoryError):
        write_json_atomic(str(tmp_path), {"x": 1})
    assert json.loads(target.read_text()) == {"kept": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]
    # results others read: the umask decides, as for open()'s files (not mkstemp's 0600)
    old = os.umask(0o022)
    try:
        write_json_atomic(str(target), {"x": 1})
    finally:
        os.umask(old)
    assert target.stat().st_mode & 0o777 == 0o644
    # a failure names the file asked for, not the temporary
    with pytest.raises(OSError) as failed:
        write_json_atomic("/sys/results.json", {"x": 1})
    assert failed.value.filename == "/sys/results.json"


def test_save_may_not_overwrite_a_checkpoint_of_the_run(tmp_path, capfd):
    ckpt = tmp_path / "ckpt"
    base = [
        "train",
        "--layers",
        "20,16,3",
        "--steps",
        "2",
        "--batch-size",
        "16",
        "--no-progress",
        "--checkpoint-dir",
        str(ckpt),
    ]
    assert cli.main(base) == 0
    kept = (ckpt / "ckpt-000000002.npz").read_bytes()
    capfd.readouterr()
    assert cli.main(base + ["--save", str(ckpt / "ckpt-000000002.npz")]) == 2
    err = capfd.readouterr().err
    assert "named like the files --checkpoint-dir keeps" in err and err.count("\n") == 1, err
    assert (ckpt / "ckpt-000000002.npz").read_bytes() == kept


@pytest.mark.parametrize(
    "field, value",
    [
        ("devices", [1, 2]),
        ("devices", "abc"),
        ("link", "garbage"),
        ("link", [1]),
        ("gpus_per_node", "garbage"),
        ("bw_scale_beyond_two", [0, 1, 1]),
    ],
)
def test_a_malformed_profile_is_one_config_error(tmp_path, field, value):
    from mgpu.selector import profiles as perf

    profile = perf.named_profile("h100-ib-2x8")
    if field == "bw_scale_beyond_two":
        profile["link"]["nccl"]["inter"][field] = value
    else:
        profile[field] = value
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    with pytest.raises(mgpu.ConfigError, match="malformed|not an mgpu|must"):
        perf.load_profile(str(path))
    with pytest.raises(mgpu.ConfigError, match="is a directory"):
        perf.load_profile(str(tmp_path))


@pytest.mark.parametrize(
    "where, field, value",
    [
        ("profile", "step_overhead_s", float("nan")),
        ("profile", "step_overhead_s", -1.0),
        ("legacy", "model_error", 100.0),
        ("legacy", "model_error", -0.1),
        ("profile", "error_model", {"compute": [0.2, -0.2], "comm": [-0.1, 0.1]}),
        ("profile", "error_model", {"compute": [-0.1, 0.1], "comm": [float("nan"), 0.1]}),
        ("profile", "error_model", {"compute": [-0.1, 0.1], "comm": [-0.1, 0.1], "speedup": [-9.0, 0.1]}),
        ("profile", "error_model", {"compute": [-0.1], "comm": [-0.1, 0.1]}),
        ("link", "step_sync_s", float("nan")),
        ("link", "buffer_bytes", -5.0),
        ("link", "alpha_s", float("inf")),
        ("device", "context_bytes", -1.0),
        ("device", "memory_bytes", -1.0),
        ("device", "dropout_s_per_unit", float("inf")),
        ("device", "host_to_device_bandwidth", float("nan")),
        ("intra", "ring_busbw", float("nan")),
    ],
)
def test_a_profile_number_no_step_can_have_is_one_config_error(where, field, value):
    # a NaN or negative figure once printed as a prediction ("nan nanx", "+-10000%")
    from mgpu.selector import profiles as perf
    from mgpu.selector import recommend as selector_recommend

    profile = perf.named_profile("h100-sxm-8")
    if where == "legacy":  # a profile from before error bands: its one relative error
        del profile["error_model"]
    target = {
        "legacy": profile,
        "profile": profile,
        "link": profile["link"],
        "device": profile["devices"][0],
        "intra": profile["link"]["nccl"]["intra"],
    }[where]
    target[field] = value
    with pytest.raises(mgpu.ConfigError, match="must be|needs finite|model_error|error band"):
        selector_recommend.recommend(model="medium", batch_size=64, profile=profile)


def test_a_profile_can_come_through_a_pipe(tmp_path):
    # `recommend --profile <(jq ... p.json)` reads a pipe: only directories are refused
    import threading

    from mgpu.selector import profiles as perf

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    text = json.dumps(perf.named_profile("h100-sxm-8"))
    writer = threading.Thread(target=lambda: fifo.write_text(text))
    writer.start()
    assert perf.load_profile(str(fifo))["name"] == "h100-sxm-8"
    writer.join()


def test_thread_counts_stop_where_openmp_would_crash():
    from mgpu.commands import main as cli_module

    parser = cli_module.build_parser()
    for argv in (
        ["train", "--threads", "100000"],
        ["topo", "--threads", "5000"],
        ["stress", "--threads", "2000"],
        ["bench", "--threads", "1,5000"],
    ):
        with pytest.raises(cli_module.UsageError, match="at most 1024"):
            parser.parse_args(argv)
    assert parser.parse_args(["train", "--threads", "1024"]).threads == 1024


def test_batch_shares_near_the_float_limit_still_split_the_batch():
    from mgpu.train.data import split_counts

    assert split_counts(256, 3, [1e308, 1e308, 1e308]) == [86, 85, 85]
    with pytest.raises(mgpu.ConfigError, match="non-negative batch shares \\(finite"):
        split_counts(256, 2, [float("inf"), 1.0])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["stress", "--iterations", "99999999999"], "at most 2147483647"),
        (["stress", "--gemm-size", "2147483647"], "at most 46340"),
        (["train", "--bucket-mb", "1e30"], "at most"),
    ],
)
def test_sizes_the_core_cannot_hold_are_refused_when_parsed(argv, message):
    with pytest.raises(cli.UsageError, match=message):
        cli.build_parser().parse_args(argv)


def test_recommend_refuses_counts_beyond_64_bits(capfd):
    for argv, message in (
        (["--model", "medium", "--batch-size", str(10**20)], "--batch-size must be at most 2^62"),
        (["--params", "inf", "--batch-size", "8"], "--params must be in 1..2^62"),
        (["--params", "1e300", "--batch-size", "8"], "--params must be in 1..2^62"),
        (["--params", "1.9", "--batch-size", "8"], "--params must be a whole number"),
        (["--model", "medium", "--batch-size", "8", "--price", "inf"], "--price must be a number from 0 to"),
        (["--model", "medium", "--batch-size", "8", "--price", "nan"], "--price must be a number from 0 to"),
        # a cost per million samples of inf was written as JSON's non-standard Infinity
        (["--model", "medium", "--batch-size", "8", "--price", "1e300"], "got 1e+300"),
    ):
        assert cli.main(["recommend", *argv]) == 2
        err = capfd.readouterr().err
        assert message in err and "Traceback" not in err, err


def test_write_line_from_a_signal_during_tqdms_import(monkeypatch, capfd):
    # The stop-signal handler writes its line between any two lines of the main thread,
    # also while tqdm is half imported (a first progress bar): an AttributeError there
    # ended a SIGUSR1-stopped train with a traceback and MPI_ABORT.
    import types

    from mgpu.console import write_line

    monkeypatch.setitem(__import__("sys").modules, "tqdm", types.ModuleType("tqdm"))
    write_line("mgpu: SIGUSR1 on rank 0: stopping at the next step boundary")
    assert capfd.readouterr().err == "mgpu: SIGUSR1 on rank 0: stopping at the next step boundary\n"


def test_auto_bucket_and_shares_price_trains_whole_step(tmp_path, monkeypatch):
    # train's step is --accumulate micro-batches of --batch-size rows, in its precision,
    # gradient type and graph mode: the selector must price that step, not one micro-batch.
    from types import SimpleNamespace

    from mgpu.selector import profiles as perf
    from mgpu.selector import recommend as selector_recommend

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    perf.save_profile(perf.named_profile("h100-sxm-8", 8))
    seen = []
    real_predict = perf.P.predict
    monkeypatch.setattr(
        selector_recommend,
        "auto_bucket",
        lambda prof, w, n, options=None: seen.append(w) or {"bucket_mb": 1.0, "reason": "test"},
    )
    monkeypatch.setattr(perf.P, "predict", lambda w, hw, n, o: seen.append(w) or real_predict(w, hw, n, o))
    cfg = mgpu.TrainConfig(
        layers=[50, 64, 3],
        batch_size=64,
        accumulate=3,
        optimizer="sgd",
        precision="bf16",
        grad_dtype="bf16",
        cuda_graph="off",
    )
    pg, sizes = SimpleNamespace(size=2), [50, 64, 3]
    tuning.auto_bucket_mb(cfg, pg, sizes, "cuda")
    tuning.auto_batch_shares(cfg, SimpleNamespace(size=8), sizes, "cuda")
    assert len(seen) == 2
    for w in seen:
        assert (w.global_batch, w.accumulate) == (64 * 3, 3)
        assert (w.precision, w.grad_dtype, w.cuda_graph) == ("bf16", "bf16", "off")
