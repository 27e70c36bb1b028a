"""TGI's metrics: its counters and histograms under TGI's names (a per-app prometheus CollectorRegistry), and the
GET /metrics route that renders them."""

from __future__ import annotations

import time

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, Histogram, disable_created_metrics,
                               generate_latest)

from hqtflow.runtime.engine import Engine


class Counters:
    """TGI's counters, exposed as TGI does: `# TYPE name counter` and the sample under the same name (no _total,
    which prometheus_client's Counter would add)."""

    def __init__(self, read: dict | None = None):
        """`read`: counters kept elsewhere, {name: (help, function giving the count)}."""
        self.values: dict[tuple[str, tuple], float] = {}
        self.help = {"tgi_request_count": "Generation requests received (validation failures included)",
                     "tgi_request_success": "Requests that succeeded", "tgi_request_failure": "Requests that failed"}
        self.read = read or {}

    def inc(self, name: str, **labels) -> None:
        key = (name, tuple(sorted(labels.items())))
        self.values[key] = self.values.get(key, 0.0) + 1

    def render(self) -> str:
        out = []
        for name, doc in self.help.items():
            out += [f"# HELP {name} {doc}", f"# TYPE {name} counter"]
            rows = [(lab, v) for (n, lab), v in sorted(self.values.items()) if n == name] or ([((), 0.0)] if name != "tgi_request_failure" else [])
            for lab, v in rows:
                tags = "{" + ",".join(f'{k}="{x}"' for k, x in lab) + "}" if lab else ""
                out.append(f"{name}{tags} {v}")
        for name, (doc, count) in self.read.items():
            out += [f"# HELP {name} {doc}", f"# TYPE {name} counter", f"{name} {float(count())}"]
        return "\n".join(out) + "\n"


class Metrics:
    """TGI's metric names."""

    def __init__(self, engine: Engine):
        disable_created_metrics()  # no `*_created` series, which TGI does not serve (prometheus_client's switch)
        r = self.registry = CollectorRegistry()
        self.counters = Counters({"hqtflow_preemptions": (
            "Sequences preempted since start (KV blocks ran out; recomputed when readmitted)", lambda: engine.stats.preemptions)})
        secs = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60)
        toks = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
        self.duration = Histogram("tgi_request_duration", "End-to-end request seconds", buckets=secs, registry=r)
        self.queue = Histogram("tgi_request_queue_duration", "Seconds a sequence waited in the queue (before its prefill and after each preemption)", buckets=secs, registry=r)
        self.per_token = Histogram("tgi_request_mean_time_per_token_duration", "Mean seconds per generated token after the first",
                                   buckets=secs, registry=r)
        self.generated = Histogram("tgi_request_generated_tokens", "Generated tokens per request", buckets=toks, registry=r)
        self.input_length = Histogram("tgi_request_input_length", "Input tokens per request (its prompts, each once)", buckets=toks, registry=r)
        self.batch_duration = Histogram("tgi_batch_inference_duration", "Forward seconds", ["method"], buckets=secs, registry=r)
        self.batch_size = Histogram("tgi_batch_inference_size", "Batch size run (after bucketing)", ["method"], buckets=toks, registry=r)
        self.next_size = Histogram("tgi_batch_next_size", "Sequences joining the batch per prefill", buckets=toks, registry=r)
        self.shapes = Gauge("hqtflow_batch_shape_runs", "Forward passes per input shape run", ["method", "batch", "seq"], registry=r)
        Gauge("tgi_queue_size", "Requests waiting", registry=r).set_function(lambda: len(engine.pending))
        Gauge("tgi_batch_current_size", "Requests in the running batch", registry=r).set_function(lambda: len(engine.active))
        Gauge("tgi_batch_current_max_tokens", "KV tokens held by the running batch (its blocks)", registry=r).set_function(
            lambda: engine.kv_tokens)

    def on_step(self, kind: str, batch: int, seconds: float, shape: tuple) -> None:
        self.batch_duration.labels(kind).observe(seconds)
        self.batch_size.labels(kind).observe(batch)
        if kind == "prefill":
            self.next_size.observe(batch)
        self.shapes.labels(kind, str(shape[0]), str(shape[1])).inc()

    def failed(self, err: str) -> None:
        """A request that failed, counted under its error type (TGI's `err` label: validation, overloaded, ...)."""
        self.counters.inc("tgi_request_failure", err=err)

    def finished(self, seconds: float, handles, counts) -> None:
        self.counters.inc("tgi_request_success")
        self.duration.observe(seconds)
        self.generated.observe(sum(counts))
        now = time.monotonic()
        for h, n in zip(handles, counts):
            self.queue.observe(h.queue_time(now))
            if h.t_first is not None and n > 1:
                self.per_token.observe((now - h.t_first) / (n - 1))

    def render(self) -> bytes:
        return self.counters.render().encode() + generate_latest(self.registry)


def metrics_router(metrics: Metrics) -> APIRouter:
    r = APIRouter()

    @r.api_route("/metrics", methods=["GET", "HEAD"])  # HEAD: as TGI (axum answers it for every GET)
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return r
