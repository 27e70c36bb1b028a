"""The CLI answers at once (heavy libraries are imported lazily) and maps each kind of user error to its exit code."""

import subprocess
import sys

import pytest
import torch

from conftest import run_cli
from hqtflow import errors


def test_help_imports_nothing_heavy():
    code = ("import sys; from hqtflow.cli import app; "
            "heavy = [m for m in ('torch', 'transformers', 'lm_eval', 'numpy') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    r = subprocess.run([sys.executable, "-m", "hqtflow", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "measure" in r.stdout


def test_version():
    from hqtflow import __version__

    r = run_cli("version")
    assert r.exit_code == 0 and r.stdout.strip() == __version__


def test_model_commands(tmp_path, monkeypatch):
    r = run_cli("model", "prepare", "llama-9000")
    assert r.exit_code == 4 and "Unknown embedded model 'llama-9000'" in r.stderr
    monkeypatch.setenv("HQTFLOW_CACHE", str(tmp_path))
    r = run_cli("model", "path", "smollm2")
    assert r.exit_code == 4 and "not prepared yet" in r.stderr


def test_error_kinds_have_distinct_exit_codes():
    kinds = [errors.ConfigError, errors.ArtifactError, errors.ModelError, errors.CalibrationError, errors.ResourceError]
    assert [k.exit_code for k in kinds] == [2, 3, 4, 5, 6] == list(errors.EXIT_CODES.values())
    assert errors.BackendError.exit_code == 2 and errors.InspectError.exit_code == 3


def test_each_kind_exits_with_its_code(tmp_path, tiny_llama, busy_port):
    """One real refusal per kind, through the CLI: one `Error:` sentence, no traceback, the kind's code."""
    text = tmp_path / "empty.txt"
    text.write_text("")
    cases = {
        2: ("generate", tiny_llama, "--dtype", "fp64"),
        3: ("quantize", "-m", tmp_path / "no-measurement", "-o", tmp_path / "ck"),
        4: ("measure", tmp_path / "no-model", "-o", tmp_path / "m", "--text", text),
        5: ("measure", tiny_llama, "-o", tmp_path / "m", "--text", text),
        6: ("serve", "bf16", tiny_llama, "--port", busy_port),
    }
    for code, argv in cases.items():
        r = run_cli(*argv)
        assert r.exit_code == code, (argv, r.output)
        assert r.stderr.startswith("Error: ") and "Traceback" not in r.output
    usage = run_cli("measure", "--no-such-flag")  # click's own usage errors share the usage code
    assert usage.exit_code == 2


def test_serve_defaults_come_from_serve_settings(monkeypatch):
    """`hqtflow serve` with no flags builds exactly ServeSettings() (the tests' default is the users' default)."""
    from hqtflow.runtime import server
    from hqtflow.runtime.api import ServeSettings

    from hqtflow.environment import TGI_KNOBS, TGI_OLDER_NAMES

    for name in (*TGI_KNOBS, *TGI_OLDER_NAMES.values(), "HQTFLOW_API_KEY", "QUANT_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    seen = {}
    monkeypatch.setattr(server, "serve", lambda model, settings, **kw: seen.update(settings=settings))
    r = run_cli("serve", "fp8", "some-model")
    assert r.exit_code == 0, r.output
    assert seen["settings"] == ServeSettings() and seen["settings"].pad_sequence_to_multiple_of == 16
    monkeypatch.setenv("PAD_SEQUENCE_TO_MULTIPLE_OF", "8")
    assert run_cli("serve", "fp8", "some-model", "--max-batch-size", "3").exit_code == 0
    assert seen["settings"] == ServeSettings(pad_sequence_to_multiple_of=8, max_batch_size=3)


def test_serve_reads_tgi_limits_from_the_environment(monkeypatch):
    """MAX_TOTAL_TOKENS, MAX_INPUT_TOKENS (or its older name MAX_INPUT_LENGTH), MAX_BATCH_PREFILL_TOKENS and
    MAX_CONCURRENT_REQUESTS are read like the other TGI knobs; a flag given wins."""
    from hqtflow.runtime import server

    seen = {}
    monkeypatch.setattr(server, "serve", lambda model, settings, **kw: seen.update(settings=settings))
    for name, value in {"MAX_TOTAL_TOKENS": "64", "MAX_INPUT_LENGTH": "32", "MAX_BATCH_PREFILL_TOKENS": "48",
                        "MAX_CONCURRENT_REQUESTS": "3", "MAX_CLIENT_BATCH_SIZE": "8", "PAYLOAD_LIMIT": "4096"}.items():
        monkeypatch.setenv(name, value)
    r = run_cli("serve", "fp8", "some-model", "--max-concurrent-requests", "5")
    assert r.exit_code == 0 and "Note:" not in r.stderr, r.output  # MAX_CLIENT_BATCH_SIZE is read: not in the note
    s = seen["settings"]
    assert (s.max_total_tokens, s.max_input_tokens, s.max_batch_prefill_tokens, s.max_concurrent_requests) == (64, 32, 48, 5)
    assert (s.max_client_batch_size, s.payload_limit) == (8, 4096)
    monkeypatch.setenv("VALIDATION_WORKERS", "2")  # TGI's, with no counterpart here: named, not silently ignored
    monkeypatch.setenv("CUDA_MEMORY_FRACTION", "0.9")
    r = run_cli("serve", "fp8", "some-model", "--max-concurrent-requests", "5")
    assert r.exit_code == 0 and "Note: CUDA_MEMORY_FRACTION=0.9, VALIDATION_WORKERS=2: TGI's launcher reads these" in r.stderr, r.output
    monkeypatch.setenv("MAX_INPUT_TOKENS", "16")
    r = run_cli("serve", "fp8", "some-model")
    assert r.exit_code == 2 and "MAX_INPUT_TOKENS and MAX_INPUT_LENGTH (its older name) are both set" in r.stderr, r.output
    monkeypatch.delenv("MAX_INPUT_LENGTH")
    monkeypatch.setenv("MAX_TOTAL_TOKENS", "8")
    r = run_cli("serve", "fp8", "some-model")
    assert r.exit_code == 2 and "MAX_INPUT_TOKENS (16) must be less than MAX_TOTAL_TOKENS (8)" in r.stderr, r.output


def test_quant_config_is_the_default_of_c(monkeypatch, tmp_path):
    """QUANT_CONFIG (optimum-habana's and TGI-on-Gaudi's) is what -c is when not given; -c wins; one that names no
    file is refused naming it."""
    from hqtflow.quantize import run

    seen = []
    monkeypatch.setattr(run, "quantize", lambda s, **kw: seen.append(s.config) or tmp_path)
    monkeypatch.setattr(run, "summary", lambda out: "done")
    argv = ("quantize", "-m", tmp_path / "m", "-o", tmp_path / "q")
    monkeypatch.setenv("QUANT_CONFIG", "pow2_quant")  # a bundled name, as -c takes it
    assert run_cli(*argv).exit_code == 0 and seen[-1].endswith("quantization_config/pow2_quant.json")
    assert run_cli(*argv, "-c", "maxabs_quant").exit_code == 0 and seen[-1] == "maxabs_quant"
    monkeypatch.setenv("QUANT_CONFIG", str(tmp_path / "nowhere.json"))
    r = run_cli(*argv)
    assert r.exit_code == 2 and r.stderr.startswith(f"Error: The environment variable QUANT_CONFIG={tmp_path / 'nowhere.json'} does not exist"), r.output
    monkeypatch.delenv("QUANT_CONFIG")
    assert run_cli(*argv).exit_code == 0 and seen[-1] is None
    from hqtflow.measure import run as measure_run

    monkeypatch.setattr(measure_run, "measure", lambda s, **kw: seen.append(s.config) or tmp_path)
    monkeypatch.setattr(measure_run, "measurement_summary", lambda out: "done")
    monkeypatch.setenv("QUANT_CONFIG", "maxabs_measure_include_outputs")
    r = run_cli("measure", "some-model", "-o", tmp_path / "m")
    assert r.exit_code == 0 and seen[-1].endswith("maxabs_measure_include_outputs.json"), r.output
    # left at the measure stage's config, QUANT_CONFIG is refused by quantize, naming it (and the other way round)
    r = run_cli(*argv)
    assert r.exit_code == 2 and r.stderr.strip() == ("Error: The environment variable QUANT_CONFIG=maxabs_measure_include_outputs "
                                                     "is a MEASURE config and this command needs a QUANTIZE one: point it at one, "
                                                     "unset it, or pass -c FILE."), r.output
    monkeypatch.setenv("QUANT_CONFIG", "maxabs_quant")
    r = run_cli("measure", "some-model", "-o", tmp_path / "m")
    assert r.exit_code == 2 and "QUANT_CONFIG=maxabs_quant is a QUANTIZE config and this command needs a MEASURE one" in r.stderr


@pytest.mark.parametrize("var,value,words", [("MAX_BATCH_SIZE", "-1", "MAX_BATCH_SIZE must be at least 0, not -1."),
                                              ("PAD_SEQUENCE_TO_MULTIPLE_OF", "0", "PAD_SEQUENCE_TO_MULTIPLE_OF must be at least 1"),
                                              ("MAX_STOP_SEQUENCES", "-1", "MAX_STOP_SEQUENCES must be at least 0")])
def test_serve_limits_from_the_environment_are_range_checked(monkeypatch, var, value, words):
    """A TGI variable out of range is refused as its flag is, naming the variable, before any model is read."""
    from hqtflow.runtime import server

    monkeypatch.setattr(server, "serve", lambda *a, **kw: pytest.fail("served"))
    monkeypatch.setenv(var, value)
    r = run_cli("serve", "fp8", "some-model")
    assert r.exit_code == 2 and r.stderr.startswith("Error: ") and words in r.stderr, r.output
    assert "Traceback" not in r.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a CUDA GPU")
@pytest.mark.parametrize("command", [["serve", "fp8", "{missing}", "--port", "1"], ["generate", "{missing}"],
                                     ["eval", "{missing}", "--ppl-file", "{missing}"], ["bench", "{missing}"]],
                         ids=["serve", "generate", "eval", "bench"])
def test_device_cuda_without_a_gpu_is_one_sentence(tmp_path, command):
    """--device cuda where PyTorch sees no GPU: exit 2 and one sentence, before the port is taken or a model is read."""
    r = run_cli(*[a.format(missing=tmp_path / "missing") for a in command], "--device", "cuda")
    assert r.exit_code == 2 and "sees no CUDA GPU here; use --device cpu" in r.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="without a CUDA GPU the default device is the CPU")
def test_generate_on_device_cpu_is_the_default_here(tiny_llama):
    default = run_cli("generate", tiny_llama, "--max-new-tokens", "4")
    on_cpu = run_cli("generate", tiny_llama, "--max-new-tokens", "4", "--device", "cpu")
    assert default.exit_code == on_cpu.exit_code == 0, default.output + on_cpu.output
    assert default.output.splitlines()[-1] == on_cpu.output.splitlines()[-1]  # the text (not the progress bars)


def _stage_then(tmp_path, error: BaseException):
    """A command (wrapped as every CLI command is) that commits one artifact and then fails with `error`."""
    import typer

    from hqtflow.cli import user_errors
    from hqtflow.formats.artifact import MANIFEST, staged_output

    def command(resolved_settings=None):
        with staged_output(tmp_path / "done") as d:
            (d / MANIFEST).write_text("{}")
        raise error

    with pytest.raises(typer.Exit) as e:
        user_errors(command)()
    return e.value.exit_code


def test_stopped_commands_say_what_they_wrote(tmp_path, capsys):
    """Interrupted after an artifact was committed (as `run` between stages), the message names it instead of
    "nothing was written"; a SIGTERM stops a command as Ctrl-C does (exit 128 + the signal); a full disk is one
    sentence and exit 6; any other OSError stays a bug's traceback."""
    import errno
    import signal

    from hqtflow.cli import Terminated

    assert _stage_then(tmp_path / "a", KeyboardInterrupt()) == 130
    assert capsys.readouterr().err.strip() == f"Interrupted; {tmp_path / 'a' / 'done'} was written, nothing else."
    assert _stage_then(tmp_path / "b", Terminated(signal.SIGTERM)) == 143
    assert capsys.readouterr().err.startswith("Terminated; ")
    full = OSError(errno.ENOSPC, "No space left on device")
    assert _stage_then(tmp_path / "c", full) == errors.ResourceError.exit_code
    assert capsys.readouterr().err.strip() == ("Error: cannot write (No space left on device): free some disk space "
                                               f"or write elsewhere; {tmp_path / 'c' / 'done'} was written, nothing else.")
    with pytest.raises(OSError):  # any other OSError is a bug: its traceback is kept
        _stage_then(tmp_path / "d", OSError(errno.EIO, "I/O error"))


def test_sigterm_stops_a_stage_and_removes_its_staging_dir(tiny_llama, wiki_text, tmp_path):
    """`kill PID` (systemd, Slurm, docker stop) during `measure`: the staging dir is removed, exit 143, one line."""
    import signal
    import time

    out = tmp_path / "m"
    cmd = [sys.executable, "-m", "hqtflow", "measure", str(tiny_llama), "-o", str(out), "--text", str(wiki_text),
           "--limit", "5000", "--max-length", "128", "--batch-size", "1"]
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    seen = ""
    while "sample/s" not in seen:  # calibrating, the staging dir made
        ch = p.stderr.read(1)
        assert ch, seen
        seen += ch
    assert any(x.name.startswith(".m.partial-") for x in tmp_path.iterdir())
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 143 and err.count("Terminated; nothing was written.") == 1, (seen + err)[-2000:]
    deadline = time.monotonic() + 10
    while list(tmp_path.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not list(tmp_path.iterdir()), sorted(x.name for x in tmp_path.iterdir())


def test_serve_reads_or_names_every_tgi_launcher_variable(monkeypatch):
    """MAX_BEST_OF and MAX_TOP_N_TOKENS are read like the other knobs (within what the server takes), MODEL_ID and
    PORT are the model's and --port's defaults, and a TGI variable with no counterpart (QUANTIZE, ...) is named in a
    note, not silently ignored."""
    from hqtflow.runtime import server

    seen = {}
    monkeypatch.setattr(server, "serve", lambda model, settings, **kw: seen.update(model=model, settings=settings, **kw))
    for name, value in {"MAX_BEST_OF": "1", "MAX_TOP_N_TOKENS": "2", "MODEL_ID": "from-env", "PORT": "8123",
                        "QUANTIZE": "gptq", "NUM_SHARD": "2"}.items():
        monkeypatch.setenv(name, value)
    r = run_cli("serve", "fp8")
    assert r.exit_code == 0, r.output
    assert (seen["model"], seen["port"], seen["settings"].max_best_of, seen["settings"].max_top_n_tokens) == ("from-env", 8123, 1, 2)
    assert "QUANTIZE=gptq, NUM_SHARD=2: TGI's launcher reads these, hqtflow serve does not" in r.stderr, r.output
    monkeypatch.setenv("QUANT_CONFIG", "maxabs_quant")  # TGI-Gaudi quantizes at start with it; here only with -m
    assert "QUANT_CONFIG=maxabs_quant (read with -m only)" in run_cli("serve", "fp8").stderr
    monkeypatch.delenv("QUANT_CONFIG")
    assert run_cli("serve", "fp8", "given", "--port", "9000", "--max-best-of", "3").exit_code == 0
    assert (seen["model"], seen["port"], seen["settings"].max_best_of) == ("given", 9000, 3)
    monkeypatch.setenv("MAX_BEST_OF", "8")
    r = run_cli("serve", "fp8")
    assert r.exit_code == 2 and "MAX_BEST_OF can be at most 4 here, not 8." in r.stderr, r.output
    r = run_cli("serve", "fp8", "--max-best-of", "2", "--max-top-n-tokens", "-1")
    assert r.exit_code == 2 and "--max-top-n-tokens must be at least 0, not -1." in r.stderr, r.output
