"""A minimal QMP client (QEMU Machine Protocol over a UNIX socket), standard library only."""

import json
import socket
import time


class QmpError(Exception):
    pass


class Qmp:
    def __init__(self, path, timeout=30.0):
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.connect(path)
                break
            except OSError:
                self.sock.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        self.timeout = timeout
        self.sock.settimeout(timeout)
        self.buf = b""
        self.events = []  # (name, host time in seconds from the event's timestamp)
        greeting = self._read()
        if "QMP" not in greeting:
            raise QmpError(f"no QMP greeting: {greeting}")
        self.cmd("qmp_capabilities")

    def _read(self):
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise QmpError("QMP connection closed")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def cmd(self, name, **args):
        msg = {"execute": name}
        if args:
            msg["arguments"] = args
        self.sock.sendall(json.dumps(msg).encode() + b"\n")
        while True:
            reply = self._read()
            if "event" in reply:
                self._note(reply)
                continue
            if "error" in reply:
                raise QmpError(f"{name}: {reply['error']}")
            return reply.get("return")

    def _note(self, ev):
        ts = ev.get("timestamp", {})
        self.events.append((ev["event"], ts.get("seconds", 0) + ts.get("microseconds", 0) / 1e6))

    def event_time(self, name):
        """Host time of the first event `name` received so far, or None."""
        for n, t in self.events:
            if n == name:
                return t
        return None

    def wait_event(self, name, timeout):
        """Waits up to `timeout` s for event `name`; returns its host time or None."""
        deadline = time.monotonic() + timeout
        while self.event_time(name) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.sock.settimeout(left)
            try:
                reply = self._read()
            except (socket.timeout, TimeoutError):
                return None
            finally:
                self.sock.settimeout(self.timeout)
            if "event" in reply:
                self._note(reply)
        return self.event_time(name)

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass
