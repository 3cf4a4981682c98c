"""``python manage.py rundemo`` (what ``make run`` calls).

Migrates the database, creates the demo sign-in once, seeds demo runs when there are none,
then runs the sandbox payments service, a worker and the web server together until Ctrl-C.
If any of them dies, the others are stopped and the command exits non-zero.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from datetime import datetime
from pathlib import Path

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError, connection

from agentops.demo.seed import demo_logins_ensure, demo_runs_seed
from agentops.demo.supervisor import Child, Supervisor
from runs.models import Run

HOST = "127.0.0.1"
STARTUP_TIMEOUT = 30.0


def base_url(port: int) -> str:
    """The address the demo's web server answers on: what emailed links start with."""
    return f"http://{HOST}:{port}"


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


class Command(BaseCommand):
    help = "Migrate, seed the demo, and run the web server, a worker and the sandbox together."

    def add_arguments(self, parser):
        parser.add_argument("--port", type=int, default=8000, help="web server port")
        parser.add_argument(
            "--sandbox-port", type=int, default=8765, help="sandbox payments service port"
        )
        parser.add_argument(
            "--mcp-port",
            type=int,
            default=settings.AGENTOPS_MCP["PORT"],
            help="MCP gateway port (streamable HTTP at /mcp/, docs/mcp.md; default "
            "AGENTOPS_MCP_PORT, 8001); 0: no gateway",
        )
        parser.add_argument("--worker-name", default="demo-1", help="the worker's identity")
        parser.add_argument("--no-seed", action="store_true", help="do not create demo runs")
        parser.add_argument(
            "--show-logs",
            action="store_true",
            help="let the processes write to this terminal instead of var/log/*.log",
        )

    def handle(self, *args, **options):
        port, sandbox_port = options["port"], options["sandbox_port"]
        mcp_port = options["mcp_port"]
        ports = [("--port", port), ("--sandbox-port", sandbox_port)]
        if mcp_port:
            ports.append(("--mcp-port", mcp_port))
        for name, value in ports:
            if not _port_free(value):
                raise CommandError(
                    f"port {value} on {HOST} is in use (is an earlier `make run` still running?); "
                    f"choose another with {name}"
                )
        if len({value for _, value in ports}) != len(ports):
            raise CommandError("--port, --sandbox-port and --mcp-port must differ")

        login = self._prepare_database(seed=not options["no_seed"])
        supervisor = self._supervisor(sandbox_port, port)
        supervisor.install_signal_handlers()
        try:
            code = self._run(supervisor, login, options)
        finally:
            supervisor.stop()
            supervisor.restore_signal_handlers()
        if code:
            sys.exit(code)
        self.stdout.write("stopped: web server, worker and sandbox")

    # --- before the processes start -----------------------------------------------------

    def _prepare_database(self, *, seed: bool):
        db = settings.DATABASES["default"]
        where = db["NAME"] if connection.vendor == "sqlite" else f"{db['NAME']} on {db['HOST']}"
        self.stdout.write(f"database: {connection.vendor} ({where})")
        try:
            call_command("migrate", interactive=False, verbosity=0)
            login = demo_logins_ensure()
            if seed:
                created = demo_runs_seed()
                if created:
                    self.stdout.write(f"seeded {len(created)} demo runs")
        except (DatabaseError, LookupError) as exc:
            raise CommandError(f"cannot prepare the database: {_first_line(exc)}") from None
        return login

    def _supervisor(self, sandbox_port: int, port: int) -> Supervisor:
        env = {
            **os.environ,
            "AGENTOPS_SANDBOX_URL": f"http://{HOST}:{sandbox_port}",
            "PYTHONUNBUFFERED": "1",
        }
        # emailed links (approvals, questions, alerts) open the web server started here,
        # on whatever port it was given; an explicit AGENTOPS_BASE_URL (a proxy in front,
        # another host name) wins
        env.setdefault("AGENTOPS_BASE_URL", base_url(port))
        env.setdefault("DJANGO_SETTINGS_MODULE", settings.SETTINGS_MODULE)
        return Supervisor(cwd=settings.BASE_DIR, env=env, out=lambda line: self.stdout.write(line))

    # --- while they run -------------------------------------------------------------------

    def _run(self, supervisor: Supervisor, login, options) -> int:
        var_dir = Path(settings.VAR_DIR)
        log_dir = None if options["show_logs"] else var_dir / "log"
        manage = str(Path(settings.BASE_DIR) / "manage.py")
        port, sandbox_port = options["port"], options["sandbox_port"]

        def log(name: str) -> Path | None:
            return log_dir / f"{name}.log" if log_dir is not None else None

        # The sandbox first: the worker's first tool calls go to it.
        sandbox = supervisor.start(
            Child(
                "sandbox",
                [
                    sys.executable,
                    "-m",
                    "agentops.demo.sandbox",
                    "--host",
                    HOST,
                    "--port",
                    str(sandbox_port),
                    "--db",
                    str(var_dir / "sandbox.sqlite3"),
                    "--mode",
                    "dedupe",
                ],
                log("sandbox"),
            )
        )
        if not self._wait_until(supervisor, f"http://{HOST}:{sandbox_port}/health"):
            return self._died_or_stopped(supervisor, sandbox)
        supervisor.start(
            Child(
                "worker",
                [sys.executable, manage, "runworker", "--name", options["worker_name"]],
                log("worker"),
            )
        )
        web = supervisor.start(
            Child(
                "web",
                [sys.executable, manage, "runserver", f"{HOST}:{port}", "--noreload"],
                log("web"),
            )
        )
        if not self._wait_until(supervisor, f"http://{HOST}:{port}/accounts/login/"):
            return self._died_or_stopped(supervisor, web)
        if options["mcp_port"]:
            # its own process: held tools/call requests never take the web server's slots
            gateway = supervisor.start(
                Child(
                    "mcp",
                    [
                        sys.executable,
                        manage,
                        "runmcp",
                        "--host",
                        HOST,
                        "--port",
                        str(options["mcp_port"]),
                    ],
                    log("mcp"),
                )
            )
            if not self._wait_until(supervisor, port=options["mcp_port"]):
                return self._died_or_stopped(supervisor, gateway)

        self._banner(supervisor, login, options, log_dir)
        watcher = _RunWatcher(self.stdout.write)
        next_look = 0.0
        while not supervisor.stop_requested:
            dead = supervisor.first_dead()
            if dead is not None:
                return self._died(dead)
            if time.monotonic() >= next_look:
                watcher.look()
                next_look = time.monotonic() + 1.0
            time.sleep(0.1)
        self.stdout.write("stopping (Ctrl-C again to kill at once)…")
        return 0

    def _wait_until(
        self, supervisor: Supervisor, url: str = "", *, port: int | None = None
    ) -> bool:
        """Until ``url`` answers 200 (or ``port`` accepts connections); False when a child
        died, a stop was asked, or time ran out."""
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if supervisor.stop_requested or supervisor.first_dead() is not None:
                return False
            if (port is not None and not _port_free(port)) or (url and _answers(url)):
                return True
            time.sleep(0.1)
        return False

    def _died_or_stopped(self, supervisor: Supervisor, waited_for: Child) -> int:
        if supervisor.stop_requested:
            return 0
        dead = supervisor.first_dead()
        if dead is not None:
            return self._died(dead)
        self.stderr.write(
            f"rundemo: the {waited_for.name} did not answer within {STARTUP_TIMEOUT:.0f}s; "
            "stopping the others"
        )
        self._show_tail(waited_for)
        return 1

    def _died(self, child: Child) -> int:
        code = child.process.returncode if child.process is not None else None
        self.stderr.write(
            f"rundemo: the {child.name} exited unexpectedly (exit code {code}); stopping the others"
        )
        self._show_tail(child)
        return 1

    def _show_tail(self, child: Child) -> None:
        tail = child.log_tail()
        if tail:
            self.stderr.write(f"--- last lines of {child.log_path} ---\n{tail}")

    def _banner(self, supervisor: Supervisor, logins, options, log_dir: Path | None) -> None:
        port, sandbox_port = options["port"], options["sandbox_port"]
        sign_ins = []
        for login in logins:
            if login.password:
                sign_ins.append(
                    f"user {login.username}, password {login.password}  (shown only this once)"
                )
            else:
                sign_ins.append(
                    f"user {login.username} (its password was shown when it was created; "
                    f"`python manage.py changepassword {login.username}` sets a new one)"
                )
        sign_in = "\n            ".join(sign_ins)
        pids = ", ".join(f"{child.name} {child.pid}" for child in supervisor.children)
        where_mail_goes = (
            "printed to the worker's log"
            if settings.EMAIL_BACKEND == "django.core.mail.backends.console.EmailBackend"
            else f"sent through {settings.EMAIL_BACKEND}"
        )
        lines = [
            "",
            "agentops is running",
            f"  open      http://{HOST}:{port}/",
            f"  sign in   {sign_in}",
            "  approve   as demo-approver the runs demo starts (nobody approves their own run)",
            f"  worker    {options['worker_name']}",
            f"  sandbox   http://{HOST}:{sandbox_port} (payments service, deduplicating)",
            f"  email     {where_mail_goes}; emailed links open "
            + os.environ.get("AGENTOPS_BASE_URL", base_url(port)),
        ]
        if options["mcp_port"]:
            lines.append(
                f"  mcp       http://{HOST}:{options['mcp_port']}/mcp/ (an agent-role token, "
                "docs/mcp.md)"
            )
        if log_dir is not None:
            lines.append(f"  logs      {log_dir}/{{web,worker,sandbox,mcp}}.log")
        lines += [f"  pids      {pids}", "Press Ctrl-C to stop them all.", ""]
        self.stdout.write("\n".join(lines))
        self.stdout.flush()


class _RunWatcher:
    """Prints the runs' status changes, so the terminal shows the demo moving."""

    def __init__(self, write) -> None:
        self.write = write
        self.seen: dict[str, str] | None = None

    def look(self) -> None:
        try:
            rows = list(
                Run.objects.order_by("-created_at").values_list(
                    "id", "agent_name", "status", "reason_code"
                )[:50]
            )
        except DatabaseError:
            return  # a busy database is not the demo's problem; look again in a second
        stamp = datetime.now().strftime("%H:%M:%S")  # noqa: DTZ005 (a local wall clock)
        if self.seen is None:
            # the first look: a summary, not a line per run
            self.seen = {str(run_id): status for run_id, _, status, _ in rows}
            counts = Counter(self.seen.values())
            summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
            self.write(f"  {stamp}  {len(rows)} recent runs: {summary or 'none'}")
            return
        for run_id, agent, status, reason in reversed(rows):
            key = str(run_id)
            before = self.seen.get(key)
            if before == status:
                continue
            self.seen[key] = status
            change = f"{before} → {status}" if before else status
            why = f" ({reason})" if reason else ""
            self.write(f"  {stamp}  run {key[:8]}  {agent:<9} {change}{why}")
