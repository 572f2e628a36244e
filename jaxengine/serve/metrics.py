"""Prometheus metrics at `GET /metrics`, under vLLM's names where they mean the same and
`jaxengine:` for the engine's own (the prefix cache's checkpoints, speculation).

Request latencies are observed by the server as requests finish; everything the engine
counts (tokens, prefix-cache queries and hits, pool use) is read from `LLM.stats()` when
the metrics are scraped, so the two can never disagree."""

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxengine.engine.engine_loop import EngineLoop

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
disable_created_metrics()  # no `_created` series beside each counter, as vLLM

E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class ServerMetrics:
    """The server's registry: request histograms and counters, and the engine's figures."""

    def __init__(self, loop: EngineLoop, model_name: str):
        self.registry = CollectorRegistry()
        self.loop = loop
        self.model_name = model_name
        labels = ["model_name"]
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token, seconds.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between successive output tokens, seconds.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Time from arrival to the last token, seconds.",
            labels,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of finished requests.", labels, registry=self.registry
        ).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Output tokens of finished requests.", labels, registry=self.registry
        ).labels(model_name)
        self.success = Counter(
            "vllm:request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(self))

    def aborted(self, samples: int) -> None:
        """Counts samples aborted because their client went away."""
        if samples:
            self.success.labels(self.model_name, "abort").inc(samples)

    def finished(self, outputs) -> None:
        """Counts one finished request (all its prompts' samples)."""
        for out in outputs:
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            for c in out.outputs:
                self.generation_tokens.inc(len(c.token_ids))
                self.success.labels(self.model_name, c.finish_reason or "abort").inc()
                m = c.metrics
                if m is not None and m.first_token_time is not None:
                    self.ttft.observe(m.first_token_time - m.arrival_time)
                if m is not None and m.finish_time is not None:
                    self.e2e.observe(m.finish_time - m.arrival_time)


class _EngineCollector:
    """What the engine counts, read at each scrape."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        m = self.metrics
        stats = m.loop.llm.stats()
        running, waiting = m.loop.load()

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([m.model_name], value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([m.model_name], value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", waiting)
        blocks = stats.get("cache_blocks") or 1
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of the cache pool in use (1 = full).",
            stats.get("blocks_in_use", 0) / blocks,
        )
        yield counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.get("tokens_asked", 0)
        )
        yield counter("vllm:prefix_cache_hits", "Prompt tokens the prefix cache served.", stats.get("tokens_hit", 0))
        yield counter("vllm:num_preemptions", "Preempted requests (recomputed later).", stats.get("preemptions", 0))
        yield gauge(
            "jaxengine:checkpoints_held",
            "Recurrent-state checkpoints in the prefix cache.",
            stats.get("checkpoints_held", 0),
        )
        yield gauge(
            "jaxengine:checkpoint_bytes",
            "Bytes of the prefix cache's recurrent-state checkpoints.",
            stats.get("checkpoint_bytes_held", 0),
        )
        yield gauge(
            "jaxengine:kv_page_bytes", "Bytes of the prefix cache's KV pages.", stats.get("kv_page_bytes_held", 0)
        )
        yield counter(
            "jaxengine:tokens_lost_for_want_of_checkpoint",
            "Prompt tokens whose KV pages were cached but no checkpoint ended the hit there.",
            stats.get("tokens_lost_for_want_of_checkpoint", 0),
        )
        yield counter("jaxengine:checkpoint_evictions", "Checkpoints evicted.", stats.get("checkpoint_evictions", 0))
        yield gauge(
            "jaxengine:device_idle_fraction",
            "Share of the device's time idle between engine steps since start.",
            stats.get("device_idle_fraction", 0.0),
        )
        yield counter(
            "jaxengine:steps_overlapped",
            "Engine steps dispatched while the step before ran (async scheduling).",
            stats.get("steps_overlapped", 0),
        )
        yield counter(
            "jaxengine:steps_synchronous",
            "Engine steps dispatched with none in flight (after idling, or needing the last tokens on the host).",
            stats.get("steps_synchronous", 0),
        )
        for phase in ("host_before", "dispatch", "device_wait", "host_after", "device_idle_gap"):
            yield gauge(
                f"jaxengine:step_{phase}_ms",
                f"Median milliseconds of a step's {phase.replace('_', ' ')} (recent steps).",
                stats.get(f"step_{phase}_ms", 0.0),
            )
        if "spec_draft_tokens" in stats:
            yield counter("jaxengine:spec_decode_draft_tokens", "Draft tokens verified.", stats["spec_draft_tokens"])
            yield counter(
                "jaxengine:spec_decode_accepted_tokens", "Draft tokens accepted.", stats["spec_accepted_tokens"]
            )
            yield gauge(
                "jaxengine:spec_decode_acceptance_rate", "Accepted / drafted tokens.", stats["spec_acceptance_rate"]
            )
