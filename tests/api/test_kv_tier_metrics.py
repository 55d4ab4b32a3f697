"""The KV tiers' counters in /metrics: one family per counter, labelled by tier, and the
prefetch latency as a histogram and quantiles (api/server/metrics.py), from a real store."""

from __future__ import annotations

import pickle
import urllib.request

import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer_jax.api.server.metrics import ServerMetrics
from deepinfer_jax.config.kv_tiers import KVTierConfig
from deepinfer_jax.host.kv_tiers import TierEntry, TierStore
from deepinfer_jax.host.kv_tiers.prefetch import TierWorker


def test_tier_counters_and_latency_reach_the_scrape(tmp_path):
    # a host tier of one entry over a disk tier: the second put pushes the first to disk
    store = TierStore(KVTierConfig(host_bytes=100, disk_dir=str(tmp_path), disk_bytes=1 << 20))
    worker = TierWorker(store)
    worker.put([TierEntry(k, (np.zeros(80, np.uint8),)) for k in (1, 2)])
    worker.prefetch([1, 3])                     # 1: from disk; 3: nowhere
    worker.drain()
    # 1 came up from disk into host memory (pushing 2 down): the loop finds it there now
    assert worker.take(1)[1] is not None and worker.get_host(1) is not None
    metrics = ServerMetrics()
    # the reports as an engine process ships them (api/server/engine_loop.py): pickled
    metrics.engine.kv_tiers = lambda: pickle.loads(pickle.dumps(worker.stats()))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(metrics.render().decode())
               for s in f.samples}

    def value(name, **labels):
        return samples[("deepinfer_kv_tier_" + name, tuple(sorted(labels.items())))]

    assert value("hits_total", tier="disk") == 1 and value("hits_total", tier="host") >= 1
    assert value("misses_total", tier="disk") == 1      # 3: in no tier
    assert value("evictions_total", tier="host") >= 1
    assert value("bytes_in_total", tier="host") >= 160 and value("bytes_out_total", tier="disk") > 80
    assert value("entries", tier="disk") == 2 and value("entries", tier="host") == 1
    assert value("prefetch_latency_seconds_count", tier="disk") == 1
    assert value("prefetch_latency_seconds_bucket", tier="disk", le="+Inf") == 1
    assert value("prefetch_latency_quantile_seconds", tier="disk", quantile="0.5") > 0
    assert value("prefetch_latency_seconds_count", tier="host") == 1
    worker.close()


@pytest.mark.slow       # a combination (KV tiers x the server): the counters' scrape stays in CI's tier
def test_a_served_engine_with_tiers_reports_them(tmp_path):
    """The engine thread hands the tiers' reports to the collector: a server whose LLM has a
    host and a disk tier shows both in /metrics (nothing evicted yet: zeros)."""
    from deepinfer_jax.api.llm import LLM
    from tests.api.conftest import MODEL, running_server

    llm = LLM(max_num_seqs=2, batch_invariant=True, enable_prefix_caching=True, token_buckets=(16, 256),
              kv_host_tier_bytes=1 << 26, kv_disk_tier_dir=str(tmp_path),
              kv_disk_tier_bytes=1 << 26)
    with running_server(llm) as (_, base_url):
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                               timeout=30)
        client.completions.create(model=MODEL, prompt="Hello there", max_tokens=2)
        with urllib.request.urlopen(base_url + "/metrics", timeout=10) as response:
            text = response.read().decode()
    found = {(s.name, s.labels.get("tier")) for f in text_string_to_metric_families(text)
             for s in f.samples}
    for tier in ("host", "disk"):
        assert ("deepinfer_kv_tier_hits_total", tier) in found
        assert ("deepinfer_kv_tier_prefetch_latency_seconds_count", tier) in found
