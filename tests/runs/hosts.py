"""Worker "hosts" for tests: each a network namespace with its own address on its own veth
link, reaching the database and the sandbox only through TCP forwarders in this process that a
test can cut and restore. Root and ``ip netns`` only (``hosts_available``); everything made is
removed again (``Hosts.cleanup``)."""

from __future__ import annotations

import os
import random
import select
import shutil
import socket
import subprocess
import threading
from contextlib import suppress


def hosts_available() -> str:
    """Why hosts cannot be made here, or "" when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` is unavailable: {probe.stderr.strip()}"
    return ""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Link:
    """TCP forwarders from one host-side address to services on this machine's loopback.

    ``cut()`` is a partition, not a crash: nothing is refused or reset, bytes simply stop
    moving both ways (they wait in the kernel's buffers and in here) and new connections are
    not served, so the host's processes keep running and block on the network, as behind a
    pulled cable. ``restore()`` lets everything held through, late — as TCP retransmission
    would deliver it."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._up = threading.Event()
        self._up.set()
        self._closed = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    def forward(self, target: tuple[str, int]) -> int:
        """Listen on this link's address; return the port that reaches ``target``."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.address, 0))
        listener.listen(64)
        self._track(listener)
        threading.Thread(target=self._accept, args=(listener, target), daemon=True).start()
        return listener.getsockname()[1]

    def cut(self) -> None:
        self._up.clear()

    def restore(self) -> None:
        self._up.set()

    def close(self) -> None:
        self._closed = True
        self._up.set()
        with self._lock:
            for sock in self._sockets:
                with suppress(OSError):
                    sock.close()

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)

    def _accept(self, listener: socket.socket, target: tuple[str, int]) -> None:
        while not self._closed:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            self._up.wait()  # a connection made during a cut is served after it
            try:
                upstream = socket.create_connection(target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            self._track(client)
            self._track(upstream)
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, one: socket.socket, other: socket.socket) -> None:
        peers = {one: other, other: one}
        try:
            while not self._closed:
                self._up.wait()
                readable, _, _ = select.select(list(peers), [], [], 0.1)
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        return
                    # read just before a cut: held until the restore, like the rest
                    self._up.wait()
                    peers[sock].sendall(data)
        except (OSError, ValueError):  # ValueError: closed under us by close()
            return
        finally:
            for sock in peers:
                with suppress(OSError):
                    sock.close()


class Host:
    """A network namespace joined to this machine by a veth pair, with a ``Link``."""

    def __init__(self, name: str, root_side: str, host_side: str, subnet: str) -> None:
        self.name = name
        self.root_side = root_side
        self.gateway = f"{subnet}.1"  # this machine's end: where the host's forwarders listen
        self.address = f"{subnet}.2"
        _ip("netns", "add", name)
        _ip("link", "add", root_side, "type", "veth", "peer", "name", host_side)
        _ip("link", "set", host_side, "netns", name)
        _ip("addr", "add", f"{self.gateway}/30", "dev", root_side)
        _ip("link", "set", root_side, "up")
        _ip("netns", "exec", name, "ip", "addr", "add", f"{self.address}/30", "dev", host_side)
        _ip("netns", "exec", name, "ip", "link", "set", host_side, "up")
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        self.link = Link(self.gateway)

    @property
    def command_prefix(self) -> list[str]:
        """Run a command on this host: ``ip netns exec`` execs it (the pid stays the same)."""
        return ["ip", "netns", "exec", self.name]

    def kill_everything(self) -> None:
        """SIGKILL every process on the host: the host dies wholesale."""
        pids = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True)
        for pid in pids.stdout.split():
            with suppress(ProcessLookupError):
                os.kill(int(pid), 9)

    def remove(self) -> None:
        self.link.close()
        self.kill_everything()
        with suppress(subprocess.CalledProcessError):
            _ip("netns", "del", self.name)  # takes its end of the veth pair, and so both
        with suppress(subprocess.CalledProcessError):
            _ip("link", "del", self.root_side)


class Hosts:
    """Hosts for one test, with names and a 10.x.y.0/30 subnet each that no interface of this
    machine uses; ``cleanup()`` removes them all."""

    def __init__(self) -> None:
        self.tag = f"ao{os.getpid() % 10000:04d}{random.randrange(100):02d}"
        self.made: list[Host] = []

    def add(self) -> Host:
        index = len(self.made) + 1
        used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
        while True:
            subnet = f"10.{random.randrange(200, 250)}.{random.randrange(256)}"
            if f" {subnet}." not in used:
                break
        # interface names: at most 15 characters
        host = Host(f"{self.tag}h{index}", f"{self.tag}r{index}", f"{self.tag}n{index}", subnet)
        self.made.append(host)
        return host

    def cleanup(self) -> None:
        for host in self.made:
            host.remove()
