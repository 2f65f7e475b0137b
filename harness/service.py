"""The host's production vLLM server, from the workstation: start, stop, status, and its live metrics.

Each operation is one runctl call on the host (two when the code bundle there is out of date), which
runs remote/runtime/service.py -- the same code the run wrapper's guard and a deploy use -- so a
server the harness runs (``service.vllm``) and one run by your own commands (``stop``/``start``/
``health``) are driven the same way. ``start`` returns once the server is healthy (polling its
status) or says why it is not; the server itself runs detached, so a dropped link leaves it starting.

Metrics are vLLM's Prometheus counters, parsed on the host with prometheus_client (the host's python
has it beside vLLM): ``metrics(since=None)`` is everything since the server started, ``since`` an
earlier reading's ``counters`` gives the interval between the two (``inv serve.metrics --watch``).
"""
from __future__ import annotations

import base64
import time
from typing import Callable

from harness import runs
from harness.connection import HostConnection
from harness.envfile import render_env
from harness.errors import HarnessError
from harness.inventory import Inventory


def require_service(conn: HostConnection):
    svc = conn.host.service
    if svc is None:
        raise HarnessError(f"host {conn.name}: no service in the inventory; add hosts.{conn.name}.service "
                           "(vllm: for a server the harness runs, or your stop/start/health commands)",
                           kind="no service")
    return svc


def control(conn: HostConnection, inv: Inventory | None, op: str, environ: dict | None = None, **args) -> dict:
    """One service operation on the host (runctl ``service``): start, stop, status or metrics."""
    require_service(conn)
    host = conn.host
    inv = inv.for_host(host.name) if inv else None
    env_text = render_env(host, inv, environ=environ).text
    code_sha, tar = runs.code_bundle()
    req = {"op": op, "code_sha": code_sha, "service": runs.service_payload(host, inv, env_text), **args}
    res = runs.runctl(conn, "service", **req)
    if res.get("need_code"):
        res = runs.runctl(conn, "service", **req, code_tar=base64.b64encode(tar).decode())
    return res


def status(conn: HostConnection, inv: Inventory | None) -> dict:
    return control(conn, inv, "status")


def stop(conn: HostConnection, inv: Inventory | None, grace: float = 60.0) -> dict:
    return control(conn, inv, "stop", grace=grace)


def start(conn: HostConnection, inv: Inventory | None, *, wait: bool = True, timeout: float | None = None,
          poll: float = 2.0, on_wait: Callable[[float], None] | None = None) -> dict:
    """Start the server (nothing to do when it runs) and, with ``wait``, return its status once it is
    healthy; a server that exits, or is not healthy within ``timeout`` (the inventory's
    ``health_timeout``), is an error naming the reason (the server log's last error)."""
    svc = require_service(conn)
    started = control(conn, inv, "start")
    if not wait:
        return {"start": started}
    timeout = timeout or svc.health_timeout
    t0 = time.monotonic()
    while True:
        st = status(conn, inv)
        if st.get("healthy"):
            return {**st, "start": started, "seconds": round(time.monotonic() - t0, 1)}
        if st.get("running") is False:
            raise HarnessError(f"host {conn.name}: the service exited before it was healthy: "
                               f"{st.get('last_error') or 'no error in its log'}; see {st.get('log')}",
                               kind="service failed")
        if time.monotonic() - t0 > timeout:
            raise HarnessError(f"host {conn.name}: the service is not healthy {timeout:.0f} s after its start; "
                               f"see {st.get('log')}", kind="service unhealthy")
        if on_wait:
            on_wait(time.monotonic() - t0)
        time.sleep(poll)


def metrics(conn: HostConnection, inv: Inventory | None, since: dict | None = None) -> dict:
    """``{"counters": totals now, "summary": acceptance length, rates, tokens/s... since ``since``}``."""
    return control(conn, inv, "metrics", since=since)
