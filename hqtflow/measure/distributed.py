"""Tensor-parallel measurement: launching ranks with torchrun and the few collectives the stage needs.

Ranks are started by `torch.distributed.run --standalone` (a free port is picked for the rendezvous; `rank_launcher`
leaves out torchrun's report of a failed rank, which prints its own error) with OMP_NUM_THREADS=1, or by the user's
own torchrun; each loads the model with transformers' `tp_plan="auto"` and observes its local shards. The ranks run
on the CPU (gloo), as the 1-rank measurement does, a GPU or not: the ranks `--tp` starts see none
(CUDA_VISIBLE_DEVICES empty), and a rank of the user's torchrun hides it before CUDA starts (transformers' tp_plan
puts the shards on whatever accelerator is visible).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from hqtflow import environment
from hqtflow.environment import in_torchrun  # noqa: F401 - re-exported (callers ask distributed)
from hqtflow.errors import EXIT_CODES, HqtflowError, ModelError
from hqtflow.formats.artifact import remove_stale_partials


def check_tp_split(config: dict, tp: int) -> None:
    """Refuse a TP degree that does not divide the model's heads or MLP, or a model transformers has no
    tensor-parallel plan for, before any rank is started."""
    from transformers import CONFIG_MAPPING

    kind = config.get("model_type")
    if kind in CONFIG_MAPPING and not getattr(CONFIG_MAPPING[kind], "base_model_tp_plan", None):
        raise ModelError(f"--tp {tp} cannot split this model: transformers has no tensor-parallel plan for {kind!r} "
                         "models; measure it on one rank (without --tp).")
    text = config.get("text_config", config)
    checks = {
        "attention heads": text.get("num_attention_heads"),
        "key/value heads": text.get("num_key_value_heads") or text.get("num_attention_heads"),
        "intermediate size": text.get("intermediate_size"),
    }
    for what, n in checks.items():
        if n is not None and n % tp:
            raise ModelError(f"--tp {tp} cannot split this model: its {n} {what} are not divisible by {tp}.")


def init(tp: int) -> tuple[int, int]:
    """(rank, world_size); initialises the process group inside torchrun."""
    if not in_torchrun():
        return 0, 1
    import torch
    import torch.distributed as dist

    world = environment.world_size()
    if world != tp:
        raise HqtflowError(f"torchrun started {world} ranks but --tp is {tp}; they must match.")
    if not dist.is_initialized():
        environment.hide_gpus()  # the ranks measure on the CPU
        if torch.cuda.is_available():
            raise HqtflowError("--tp ranks measure on the CPU, but this rank already sees a CUDA GPU: start torchrun "
                               "with CUDA_VISIBLE_DEVICES set empty.")
        dist.init_process_group(backend="gloo")
    return dist.get_rank(), world


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def broadcast_path(create: Callable[[], Path] | None) -> Path:
    """Rank 0 calls `create()`; every rank gets its result."""
    dist = _dist()
    if dist is None:
        return create()
    box = [str(create()) if create is not None else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on rank 0 (others get [])."""
    dist = _dist()
    if dist is None:
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out or []


def barrier() -> None:
    if (dist := _dist()) is not None:
        dist.barrier()


def shutdown() -> None:
    if (dist := _dist()) is not None:
        dist.destroy_process_group()


class RankFailed(HqtflowError):
    """A rank of `measure --tp` failed; it printed its own error. The exit code is its own (a user error's kind)."""

    def __init__(self, tp: int, code: int):
        self.exit_code = code if code in EXIT_CODES.values() else HqtflowError.exit_code
        kind = next((k for k, c in EXIT_CODES.items() if c == code), None)
        what = f"on the error named above (exit code {code}: {kind})" if kind else \
            f"with exit code {code}; see the rank output above"
        super().__init__(f"Measurement with --tp {tp} failed: a rank stopped {what}.")


def launch(settings, *, trust_pickle: bool = False) -> Path:
    """Run `hqtflow measure` on `settings.tp` ranks with torchrun and wait for them (`--trust-pickle` on each rank
    with `trust_pickle`)."""
    out = Path(settings.output)
    with tempfile.TemporaryDirectory(prefix="hqtflow-launch-") as tmp:
        spec = Path(tmp) / "settings.json"
        spec.write_text(json.dumps(settings.to_json()))
        cmd = [
            sys.executable, "-m", "hqtflow.measure.rank_launcher", "--standalone", f"--nproc-per-node={settings.tp}",
            "-m", "hqtflow", "measure", "--resolved-settings", str(spec),
            *(["--trust-pickle"] if trust_pickle else []),  # the launcher's opt-in, for every rank
        ]
        returncode = _run_ranks(cmd, out)
    if returncode != 0:
        remove_stale_partials(out.parent)  # the ranks have exited: their staging dir is a dead process's
        raise RankFailed(settings.tp, returncode)
    return out


def _run_ranks(cmd: list[str], out: Path) -> int:
    """Run torchrun and return its exit code. Interrupted, torchrun is killed (quietly, as subprocess.run does) and its
    ranks are stopped too before this returns: a SIGINT sent to this process alone, unlike Ctrl-C's to the whole
    group, never reaches them, and they would run on and write the output after `Interrupted; nothing was written`."""
    p = subprocess.Popen(cmd, env=environment.rank_env())
    try:
        return p.wait()
    except KeyboardInterrupt:
        ranks = _children(p.pid)
        p.kill()
        p.wait()
        _stop(ranks)
        _remove_partials(out, ranks)
        raise


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return kids


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _stop(pids: list[int], limit: float = 60.0) -> None:
    """SIGINT the ranks still running (as torchrun does on Ctrl-C; a second one is harmless) and wait for them."""
    for q in pids:
        try:
            os.kill(q, signal.SIGINT)
        except ProcessLookupError:
            pass
    start = time.monotonic()
    while any(_running(q) for q in pids) and time.monotonic() - start < limit:
        time.sleep(0.1)


def _remove_partials(out: Path, ranks: list[int]) -> None:
    """The staging dirs of these ranks (rank 0 makes one), never another run's."""
    for pid in ranks:
        for leftover in out.parent.glob(f".{out.name}.partial-{pid}-*"):
            shutil.rmtree(leftover, ignore_errors=True)
