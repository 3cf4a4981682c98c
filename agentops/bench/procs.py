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

MANAGE = str(Path(settings.BASE_DIR) / "manage.py")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class WorkerFailed(RuntimeError):
    pass


class BenchWorker:
    def __init__(self, name: str, env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.started_at = time.time()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                # without Django's system checks, as runworker itself starts (they are not
                # part of a worker's cold start: runs/management/commands/runworker.py)
                [sys.executable, MANAGE, "bench", "--worker", name, "--skip-checks"],
                cwd=settings.BASE_DIR,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_running(self, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while f"worker {self.name} running" not in self.output():
            if not self.alive:
                raise WorkerFailed(f"worker {self.name} exited:\n{self.output()[-2000:]}")
            if time.monotonic() > end:
                raise WorkerFailed(f"worker {self.name} did not start in {timeout:.0f}s")
            time.sleep(0.05)

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM to the main process only (RECIPES: to the group it hangs ~90 s)."""
        if not self.alive:
            return
        with suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        # orphaned cluster children, if any, go with the group
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)

    def kill(self) -> None:
        """A crash: SIGKILL of the whole process group."""
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            self.process.wait(10)

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
