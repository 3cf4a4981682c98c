"""Worker processes the benchmark starts, and what /proc says about them.

Each worker is ``manage.py bench --worker NAME``: it registers the no-op bench agents and
then runs the ordinary ``runworker`` (identity, sweeper, django-q2 cluster), in its own
process group so a crash is a SIGKILL of the whole group, as in production.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

from django.conf import settings

from agentops.workerprocs import WorkerFailed, WorkerProcess

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class BenchWorker(WorkerProcess):
    """``manage.py bench --worker NAME``: the no-op bench agents registered, then the ordinary
    ``runworker``, started and stopped by the shared helper (``agentops.workerprocs``)."""

    def __init__(self, name: str, env: dict[str, str], log_dir: Path) -> None:
        # without Django's system checks, as runworker itself starts (they are not part of a
        # worker's cold start: runs/management/commands/runworker.py)
        super().__init__(
            name,
            env,
            log_dir / f"{name}.log",
            command=["bench", "--worker", name, "--skip-checks"],
        )

    def kill(self) -> None:
        """A crash: SIGKILL of the whole process group."""
        self.kill_group(timeout=10)

    def group_pids(self) -> list[int]:
        return group_pids(self.pid)


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name may contain spaces: fields start after its closing parenthesis
    return raw[raw.rindex(")") + 2 :].split()


def group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(int(entry))
        if fields is not None and int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of these processes, plus that of their children that exited (a
    django-q2 worker process is recycled after a number of tasks)."""
    total = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            # utime, stime, cutime, cstime
            total += sum(int(value) for value in fields[11:15])
    return total / CLOCK_TICKS


def rss_bytes(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_SIZE
    except (OSError, IndexError, ValueError):
        return 0


class Server:
    def __init__(self, process: subprocess.Popen, log_path: Path) -> None:
        self.process = process
        self.log_path = log_path

    def stop(self) -> None:
        with suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


def gunicorn(ctx, *, port: int, workers: int = 2, timeout: float = 60) -> Server:
    """The web process as the Procfile runs it, on the bench database, over plain http."""
    import httpx

    env = ctx.worker_env(
        SECURE_SSL_REDIRECT="0",
        SESSION_COOKIE_SECURE="0",
        CSRF_COOKIE_SECURE="0",
        AGENTOPS_API_USER_RATE="10000000/min",
        AGENTOPS_API_ANON_RATE="10000000/min",
    )
    hosts = env.get("ALLOWED_HOSTS", "")
    env["ALLOWED_HOSTS"] = ",".join(filter(None, [hosts, "127.0.0.1"]))
    log_path = ctx.log_dir / "gunicorn.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gunicorn",
                "agentops.wsgi",
                "--bind",
                f"127.0.0.1:{port}",
                "--workers",
                str(workers),
                "--log-level",
                "warning",
            ],
            cwd=settings.BASE_DIR,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = Server(process, log_path)
    end = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise WorkerFailed(f"gunicorn exited:\n{log_path.read_text(errors='replace')[-2000:]}")
        try:
            httpx.get(f"http://127.0.0.1:{port}/api/v1/health/", timeout=1)
            return server
        except httpx.HTTPError:
            if time.monotonic() > end:
                server.stop()
                raise WorkerFailed(f"gunicorn did not answer on port {port}") from None
            time.sleep(0.1)
