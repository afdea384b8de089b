"""The sim's Prometheus surface: vLLM's metric names and labels, read from the engine at scrape time."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from replica.engine import Engine

# vLLM's classic TTFT buckets (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


class EngineCollector:
    """Reads the engine's counters at scrape time, under vLLM's metric names."""

    def __init__(self, engine: Engine, model_name: str, engine_label: str) -> None:
        self.engine = engine
        self.values = [model_name, engine_label]

    def collect(self) -> Iterable[Metric]:
        eng = self.engine
        stats = eng.stats
        names = ["model_name", "engine"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(self.values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(self.values, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    eng.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    eng.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    eng.kv_usage())
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.", stats.queries)
        yield counter("vllm:prefix_cache_hits",
                      "Prefix cache hits, in terms of number of cached tokens.", stats.hits)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      stats.preemptions)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                      stats.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      stats.generation_tokens)
        yield counter("vllm:request_success", "Count of successfully processed requests.",
                      stats.finished)
        # Not a vLLM metric (vLLM only samples eviction ages): the sim counts every eviction.
        yield counter("sim:kv_block_evictions", "Cached KV blocks evicted for reuse.",
                      stats.evictions)
        yield gauge("sim:kv_cached_blocks", "Blocks currently holding a cached key.",
                    eng.kv.pool.num_cached_blocks())
