"""The server's connections: clients that stall are let go (nginx's client_header/body and send timeouts, which
uvicorn lacks), and the process may open as many sockets as its hard limit allows."""

from __future__ import annotations

import logging

log = logging.getLogger("uvicorn.error")


def check_port(port: int, name: str = "--port") -> None:
    """A --port is a TCP port, 1 to 65535 (serve's to listen on, handoff's for TGI-Gaudi's `docker run -p`); `name`:
    what set it (the flag, or PORT)."""
    from hqtflow.errors import HqtflowError

    if not 1 <= port <= 65535:
        raise HqtflowError(f"{name} must be between 1 and 65535, not {port}.")


def protocol(timeout: float):
    """uvicorn's h11 protocol, with `timeout` seconds (0: none) for a client to send a whole request (from connecting,
    or from its previous answer on a kept-alive connection) and to read again when the server cannot write to it.
    A connection past either is aborted, which the app sees as the client leaving: a running request is cancelled and
    its place freed, a body half-read is a cancelled request."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        request_timer = stall_timer = None
        unsent = 0  # bytes waiting in the transport when the stall timer was armed

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._await_request()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._await_request()

        def connection_lost(self, exc) -> None:
            for timer in (self.request_timer, self.stall_timer):
                if timer is not None:
                    timer.cancel()
            super().connection_lost(exc)

        def _await_request(self) -> None:
            if timeout:
                if self.request_timer is not None:
                    self.request_timer.cancel()
                self.request_timer = self.loop.call_later(timeout, self._request_late)

        def _request_late(self) -> None:
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
                self._let_go("sent no whole request")

        def pause_writing(self) -> None:  # the socket's buffers are full: the client reads slower than we write
            super().pause_writing()
            if timeout and self.stall_timer is None:
                self._watch_stall()

        def resume_writing(self) -> None:
            super().resume_writing()
            if self.stall_timer is not None:
                self.stall_timer.cancel()
                self.stall_timer = None

        def _watch_stall(self) -> None:
            self.unsent = unsent(self.transport)
            self.stall_timer = self.loop.call_later(timeout, self._stalled)

        def _stalled(self) -> None:
            if unsent(self.transport) < self.unsent:  # it took some: a slow client, not a gone one
                self._watch_stall()
            else:
                self._let_go("read nothing of its answer")

        def _let_go(self, what: str) -> None:
            client = "%s:%d" % self.client[:2] if self.client else "a client"
            log.info("%s %s in %g s (--client-timeout): connection closed", client, what, timeout)
            self.transport.abort()  # not close(): that would wait to flush what the client does not read

    return Protocol


def unsent(transport) -> int:
    """Bytes written for the client that it has not taken: the transport's buffer, plus (Linux) the socket's send
    queue, which only shrinks as the client reads (the transport's buffer moves only once a third of a send buffer
    of megabytes is free, so alone it cannot tell a slow reader from a gone one)."""
    import struct

    queued = transport.get_write_buffer_size()
    try:
        import fcntl
        import termios

        return queued + struct.unpack("i", fcntl.ioctl(transport.get_extra_info("socket").fileno(), termios.TIOCOUTQ,
                                                       b"\0\0\0\0"))[0]
    except (ImportError, OSError, AttributeError, ValueError):  # not a socket, or no TIOCOUTQ (not Linux)
        return queued


def raise_open_files_limit() -> None:
    """Lift the soft limit on open files to the hard one, as servers do (vLLM too): each connection is a socket."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # a hard limit the platform will not give (macOS's RLIM_INFINITY)
            pass
