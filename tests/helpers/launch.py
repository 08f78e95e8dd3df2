"""Start moh-dit jobs on two CPU processes, as users start them, and stop them as a scheduler or a crash would.

Both launchers users reach for are covered: ``torchrun --standalone`` and ``accelerate launch --multi_gpu`` (on a
CPU machine accelerate's ``--cpu`` flag starts one process only). Jobs run in their own session with one thread
per process, their output in a log file; the helpers find the processes of each rank through ``/proc``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAUNCHERS = ("torchrun", "accelerate")


def launch(launcher: str, *args, nproc: int = 2, nodes: tuple[int, int, int] | None = None) -> list[str]:
    """The command line that runs ``args`` (a script or ``-m module`` and its arguments) on ``nproc`` processes.
    ``nodes=(count, rank, port)`` makes it one node of several, meeting at ``127.0.0.1:port``."""
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
        if nodes is None:
            cmd.append("--standalone")
        else:
            count, rank, port = nodes
            cmd += ["--nnodes", str(count), "--node_rank", str(rank), "--master_addr", "127.0.0.1"]
            cmd += ["--master_port", str(port)]
    elif launcher == "accelerate":
        assert nodes is None, "the two-node tests use torchrun"
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc)]
        cmd += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
        cmd += ["--main_process_port", str(free_port())]
    else:
        raise ValueError(launcher)
    return [*cmd, *map(str, args)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment() -> dict[str, str]:
    """The repository importable, one thread per process (two processes share two cores)."""
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


class Job:
    """A launched command: its launcher process, its log, and the processes of its ranks."""

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.cmd, self.log = cmd, Path(log)
        self._out = open(self.log, "w")  # noqa: SIM115 (closed when the job ends)
        # a session of its own, as a scheduler starts a job: signals reach the launcher only
        self.proc = subprocess.Popen(
            cmd, stdout=self._out, stderr=subprocess.STDOUT, env=environment() | (env or {}), start_new_session=True
        )
        self.started = time.time()

    @property
    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, condition: Callable[[], bool], what: str, timeout: float = 120) -> None:
        """Poll ``condition`` until it holds; a job that ends first, or the time running out, fails the test."""
        deadline = time.time() + timeout
        while not condition():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"the job ended (exit {self.proc.returncode}) before {what}:\n{self.text[-3000:]}"
                )
            if time.time() > deadline:
                self.kill()
                raise AssertionError(f"no {what} after {timeout} s:\n{self.text[-3000:]}")
            time.sleep(0.01)

    def ranks(self) -> dict[int, int]:
        """``{rank: pid}`` of the processes the launcher started (read from their environment)."""
        deadline = time.time() + 30
        while time.time() < deadline:
            found = {}
            for pid in descendants(self.proc.pid):
                rank = process_env(pid).get("RANK")
                if rank is not None and "LOCAL_RANK" in process_env(pid):
                    found[int(rank)] = pid
            if found:
                return found
            time.sleep(0.05)
        raise AssertionError("found no rank processes")

    def finish(self, timeout: float = 300) -> tuple[int, float]:
        """Wait for the launcher to exit: ``(exit code, seconds since start)``."""
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            self._out.close()
        return code, time.time() - self.started

    def kill(self) -> None:
        """Stop everything the job started (a test that failed halfway leaves nothing behind)."""
        pids = descendants(self.proc.pid)
        for pid in [self.proc.pid, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()


def run_job(cmd: list[str], log: Path, timeout: float = 300) -> str:
    """Run a launched command to the end; it must succeed. Returns its output."""
    job = Job(cmd, log)
    code, _ = job.finish(timeout)
    assert code == 0, job.text[-4000:]
    return job.text


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def process_env(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
