"""Real gRPC frontends that are not a plain Temporal dev server, for the server watch's tests:
a proxy in front of a real one that serves no `grpc.health.v1` (as some proxies and cloud
endpoints do) and may answer slowly, and a gRPC server that serves nothing at all.

Both are grpcio servers on a loopback port: a method they do not serve is answered
UNIMPLEMENTED by grpcio itself, as any gRPC server answers an unknown service. The proxy
forwards every other call's bytes and metadata to its upstream unchanged (Temporal's API
is unary calls only), so the SDK's own client talks to the real server through it.

Each frontend is its own child process (`python -m tests.activities.grpc_frontends`), so no
grpcio server or channel ever runs threads in the test process: once they have run, grpcio's
fork handlers hang or abort any child that process forks later (`Check failed:
next_worker->state == KICKED`), and the suite forks fleets, CLIs and trainers after these tests.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HEALTH = "/grpc.health.v1.Health/"


def _serve(upstream: str | None, health: bool, delay_s: float) -> None:
    """The child: serve until SIGTERM, after printing the address on stdout."""
    from concurrent import futures

    import grpc

    class Forward(grpc.GenericRpcHandler):
        def __init__(self) -> None:
            self.channel = grpc.insecure_channel(upstream)

        def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
            if details.method.startswith(HEALTH) and not health:
                return None  # grpcio answers UNIMPLEMENTED
            call = self.channel.unary_unary(details.method)  # bytes in, bytes out

            def forward(request: bytes, context: grpc.ServicerContext) -> bytes:
                time.sleep(delay_s)
                metadata = [(k, v) for k, v in context.invocation_metadata()
                            if not k.startswith(("grpc-", ":")) and k != "user-agent"]
                try:
                    return call(request, metadata=metadata, timeout=context.time_remaining())
                except grpc.RpcError as exc:  # the upstream's answer, or UNAVAILABLE
                    context.abort(exc.code(), exc.details() or "")
            return grpc.unary_unary_rpc_method_handler(forward)

    # threads enough for the long polls of a worker fleet (each holds one for up to a minute)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=128))
    server.add_generic_rpc_handlers((Forward(),) if upstream else ())
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"127.0.0.1:{port}", flush=True)
    server.wait_for_termination()


class Frontend:
    """A grpcio server on 127.0.0.1 in a child process: `Frontend.proxy(upstream, ...)` or
    `Frontend.bare()`; `.address` is where it listens, `.stop()` ends it."""

    def __init__(self, args: list[str]) -> None:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.activities.grpc_frontends", *args],
            cwd=root, stdout=subprocess.PIPE, text=True)
        self.address = self.proc.stdout.readline().strip()
        if not self.address:
            self.stop()
            raise RuntimeError(f"the gRPC frontend {args} exited before listening")

    @classmethod
    def proxy(cls, upstream: str, *, health: bool = False, delay_s: float = 0.0) -> Frontend:
        return cls(["--upstream", upstream, "--delay-s", str(delay_s)]
                   + (["--health"] if health else []))

    @classmethod
    def bare(cls) -> Frontend:
        return cls([])

    def stop(self) -> None:
        """At once: a slow frontend's handlers may be asleep in a call for another 30 s."""
        self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", help="forward to this host:port; without it, serve nothing")
    parser.add_argument("--health", action="store_true", help="forward grpc.health.v1 too")
    parser.add_argument("--delay-s", type=float, default=0.0, help="answer this much later")
    a = parser.parse_args()
    _serve(a.upstream, a.health, a.delay_s)
