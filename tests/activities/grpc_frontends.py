"""Real gRPC frontends that are not a plain Temporal dev server, for the server watch's tests:
a proxy in front of a real one that serves no `grpc.health.v1` (as some proxies and cloud
endpoints do) and may answer slowly, and a gRPC server that serves nothing at all.

Both are grpcio servers on a loopback port: a method they do not serve is answered
UNIMPLEMENTED by grpcio itself, as any gRPC server answers an unknown service. The proxy
forwards every other call's bytes and metadata to its upstream unchanged (Temporal's API
is unary calls only), so the SDK's own client talks to the real server through it.
"""

from __future__ import annotations

import time
from concurrent import futures

import grpc

HEALTH = "/grpc.health.v1.Health/"


class _Forward(grpc.GenericRpcHandler):
    def __init__(self, upstream: str, health: bool, delay_s: float) -> None:
        self.channel = grpc.insecure_channel(upstream)
        self.health, self.delay_s = health, delay_s

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if details.method.startswith(HEALTH) and not self.health:
            return None  # grpcio answers UNIMPLEMENTED
        call = self.channel.unary_unary(details.method)  # bytes in, bytes out

        def forward(request: bytes, context: grpc.ServicerContext) -> bytes:
            time.sleep(self.delay_s)
            metadata = [(k, v) for k, v in context.invocation_metadata()
                        if not k.startswith(("grpc-", ":")) and k != "user-agent"]
            try:
                return call(request, metadata=metadata, timeout=context.time_remaining())
            except grpc.RpcError as exc:  # the upstream's answer, or UNAVAILABLE when it is gone
                context.abort(exc.code(), exc.details() or "")
        return grpc.unary_unary_rpc_method_handler(forward)


class Frontend:
    """A grpcio server on 127.0.0.1: `Frontend.proxy(upstream, ...)` or `Frontend.bare()`.
    Threads enough for the long polls of a worker fleet (each holds one for up to a minute)."""

    def __init__(self, handlers: tuple[grpc.GenericRpcHandler, ...]) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=128))
        self.server.add_generic_rpc_handlers(handlers)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    @classmethod
    def proxy(cls, upstream: str, *, health: bool = False, delay_s: float = 0.0) -> Frontend:
        return cls((_Forward(upstream, health, delay_s),))

    @classmethod
    def bare(cls) -> Frontend:
        return cls(())

    def stop(self) -> None:
        self.server.stop(grace=None)
