"""The scripts of examples/ run as a user runs them, each in its own process with this
interpreter, and print the line they promise: the planted NaN caught at its step and skipped,
the weights finite, replay naming the sample; the DDP one under torch.distributed.run with two
Gloo ranks, which must skip the same step and keep equal replicas."""

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NUM = r"-?\d+\.\d+"

pytestmark = pytest.mark.slow  # each runs a script in a process of its own


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Gloo's threads sometimes abort a process as it exits, on a loaded machine, after the script's
# last collective (tests/ranks.py): torchrun then exits 1 and names the signal
GLOO_EXIT_ABORT = ("terminate called without an active exception", "(exitcode: -6)")


def run_example(args: list[str], prefix: str, gloo: bool = False) -> str:
    """Runs ``python ARGS`` from the repository root; returns the line that starts with
    ``prefix``, after checking the exit status (under ``gloo``, an abort as a rank exits after
    that line, printed once every rank's results were gathered, is not the script's failure)."""
    p = subprocess.run([sys.executable, *args], cwd=EXAMPLES.parent, capture_output=True,
                       text=True, timeout=300)
    lines = [s for s in p.stdout.splitlines() if s.startswith(prefix)]
    aborted_on_exit = gloo and len(lines) == 1 and all(m in p.stderr for m in GLOO_EXIT_ABORT)
    assert p.returncode == 0 or aborted_on_exit, \
        f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    assert len(lines) == 1, f"no single {prefix!r} line in:\n{p.stdout[-3000:]}"
    return lines[0]


def test_plain_loop():
    line = run_example([str(EXAMPLES / "plain_loop.py")], "plain_loop:")
    assert re.fullmatch(
        r"plain_loop: 1 incident \(nonfinite_loss at step 40, 2 alarms, likely cause batch: "
        r"batch on replay\), skipped=True, replay "
        rf"source=batch culprit_ids=\[1287\], weights finite=True, last loss {NUM}", line), line


def test_hf_trainer():
    pytest.importorskip("transformers")
    line = run_example([str(EXAMPLES / "hf_trainer.py")], "hf_trainer:")
    assert re.fullmatch(
        r"hf_trainer: 10 steps logged, 0 alarms, 0 skipped, clip at 1\.0, "
        rf"last loss {NUM}, grad norm {NUM}", line), line


def test_lightning_loop():
    pytest.importorskip("lightning")
    line = run_example([str(EXAMPLES / "lightning_loop.py")], "lightning_loop:")
    assert line == ("lightning_loop: 1 incident (nonfinite_loss+nonfinite_grad at step 20, "
                    "alarm), skipped=True, culprit_ids=[165], weights finite=True"), line


def test_ddp_torchrun():
    line = run_example(["-m", "torch.distributed.run", "--nproc_per_node=2",
                        f"--master_port={free_port()}", str(EXAMPLES / "ddp_torchrun.py")],
                       "ddp_torchrun:", gloo=True)
    assert re.fullmatch(
        r"ddp_torchrun: 2 ranks, skipped steps \[\[12\], \[12\]\], replicas equal=True, "
        rf"last grad norm {NUM}", line), line


def test_accumulation_loop():
    line = run_example([str(EXAMPLES / "accumulation_loop.py")], "accumulation_loop:")
    assert re.search(
        r"accumulation_loop: 1 incident \(loss_spike at step 40\), dump holds 2 micro-batches, "
        r"recorded loss (\S+), replayed \1, reproduced=True, cause batch", line), line
