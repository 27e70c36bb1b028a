"""TGI's metrics: its counters and histograms under TGI's names (a per-app prometheus CollectorRegistry), and the
GET /metrics route that renders them."""

from __future__ import annotations

import time

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
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
        self.warming = False  # set while the warm-up runs (server.warm_up)
        self.counters = Counters({"hqtflow_preemptions": (
            "Sequences preempted since start (KV blocks ran out; recomputed when readmitted)", lambda: engine.stats.preemptions)})
        secs = tuple(0.0001 * 1.5 ** k for k in range(1, 36))  # TGI's buckets of every *_duration: 0.15 ms to 209 s
        toks = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
        self.duration = Histogram("tgi_request_duration", "End-to-end request seconds", buckets=secs, registry=r)
        self.validation = Histogram("tgi_request_validation_duration", "Seconds from a request's arrival to its submission to the engine",
                                    buckets=secs, registry=r)
        self.queue = Histogram("tgi_request_queue_duration", "Seconds a request waited in the queue (before its prefill and after each preemption)", buckets=secs, registry=r)
        self.inference = Histogram("tgi_request_inference_duration", "Seconds a request ran in the batch", buckets=secs, registry=r)
        self.per_token = Histogram("tgi_request_mean_time_per_token_duration", "Inference seconds per generated token",
                                   buckets=secs, registry=r)
        self.generated = Histogram("tgi_request_generated_tokens", "Generated tokens per request", buckets=toks, registry=r)
        self.input_length = Histogram("tgi_request_input_length", "Input tokens per request (its prompts, each once)", buckets=toks, registry=r)
        self.batch_duration = Histogram("tgi_batch_inference_duration", "Forward seconds", ["method"], buckets=secs, registry=r)
        self.batch_size = Histogram("tgi_batch_inference_size", "Batch size run (after bucketing)", ["method"], buckets=toks, registry=r)
        self.next_size = Histogram("tgi_batch_next_size", "Sequences joining the batch per prefill", buckets=toks, registry=r)
        self.shapes = Counter("hqtflow_batch_shape_runs", "Forward passes per input shape run", ["method", "batch", "seq"], registry=r)
        Gauge("tgi_queue_size", "Requests waiting", registry=r).set_function(lambda: len(engine.pending))
        Gauge("tgi_batch_current_size", "Requests in the running batch", registry=r).set_function(lambda: len(engine.active))
        Gauge("tgi_batch_current_max_tokens", "KV tokens held by the running batch (its blocks)", registry=r).set_function(
            lambda: engine.kv_tokens)

    def on_step(self, kind: str, batch: int, seconds: float, shape: tuple) -> None:
        """An engine step: its shape counted always; TGI's tgi_batch_* histograms not while warming up."""
        self.shapes.labels(kind, str(shape[0]), str(shape[1])).inc()
        if self.warming:
            return
        self.batch_duration.labels(kind).observe(seconds)
        self.batch_size.labels(kind).observe(batch)
        if kind == "prefill":
            self.next_size.observe(batch)

    def failed(self, err: str) -> None:
        """A request that failed, counted under its error type (TGI's `err` label: validation, overloaded, ...)."""
        self.counters.inc("tgi_request_failure", err=err)

    def finished(self, start: float, returned: list[tuple]) -> None:
        """One successful request, once, as TGI records it: `start` its arrival (time.monotonic()), `returned` the
        (engine handle, generated tokens) of the sequences it answers with (not best_of's others). With several
        (n, several prompts): validation until the first was submitted, queue the longest wait, tokens their sum,
        time per token the inference over the longest one's (the steps they ran)."""
        now = time.monotonic()
        validation = min(h.t_submit for h, _ in returned) - start
        queue = max(h.queue_time(now) for h, _ in returned)
        inference = max(0.0, now - start - validation - queue)
        longest = max(n for _, n in returned)
        self.counters.inc("tgi_request_success")
        self.duration.observe(now - start)
        self.validation.observe(validation)
        self.queue.observe(queue)
        self.inference.observe(inference)
        self.per_token.observe(inference / longest if longest else 0.0)  # TGI's: 0 without a token
        self.generated.observe(sum(n for _, n in returned))

    def render(self) -> bytes:
        return self.counters.render().encode() + generate_latest(self.registry)


def metrics_router(metrics: Metrics) -> APIRouter:
    r = APIRouter()

    @r.api_route("/metrics", methods=["GET", "HEAD"])  # HEAD: as TGI (axum answers it for every GET)
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return r
