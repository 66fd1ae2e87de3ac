"""The service's bounded structures: configuration and what /metrics shows of them."""

from __future__ import annotations

import pytest


def test_aged_out_horizon_is_configured_validated_and_reaches_the_index():
    from kvmiss.enricher.service.serve import Service
    from kvmiss.schemas.config import ConfigError, HistoryConfig, parse_config

    assert HistoryConfig().aged_out_horizon_s == 3600.0
    config = parse_config('[metrics]\nlisten = ""\n[[workers]]\nid = "A"\nendpoint = "tcp://127.0.0.1:1"\n'
                          '[history]\naged_out_horizon_s = 7200\n')
    assert Service(config).index.aged_out_horizon_s == 7200.0
    for bad in ("0", "-5", "nan"):
        with pytest.raises(ConfigError, match="aged_out_horizon_s"):
            parse_config(f"[history]\naged_out_horizon_s = {bad}\n")


def test_the_aged_out_filter_is_shown_on_metrics_remembered_bytes_and_forgotten():
    from prometheus_client.openmetrics.exposition import generate_latest

    from kvmiss.enricher.service.serve import Service
    from kvmiss.schemas.config import parse_config
    from kvmiss.schemas.events import BlockRemoved, BlockStored
    from kvmiss.schemas.stream import AppliedBatch, RunStart

    config = parse_config('[metrics]\nlisten = ""\n[[workers]]\nid = "A"\nendpoint = "tcp://127.0.0.1:1"\n'
                          '[history]\nretention_s = 10\naged_out_horizon_s = 20\n')
    service = Service(config)
    for seq in range(100):  # one block stored and removed every engine second
        events = [BlockStored(block_hashes=[1000 + seq], parent_block_hash=None, block_size=16),
                  BlockRemoved(block_hashes=[1000 + seq])]
        service.index.apply(AppliedBatch(worker="A", epoch=0, seq=seq, ts=float(seq), recv_ts=float(seq),
                                         events=events, run_start_seq=0, run_start=RunStart.EPOCH_START))
        service.index.prune(float(seq))
    text = generate_latest(service.registry).decode()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line.startswith("kvmiss_index_aged_out")}
    # at engine time 99: dropped at prunes 10..99 (records closed before 0..89); the
    # generations (5 s each) of prunes older than 99 - 10 - 20 = 69 are forgotten
    assert 20 <= values["kvmiss_index_aged_out_remembered"] <= 26
    assert values["kvmiss_index_aged_out_bytes"] > 0
    assert values["kvmiss_index_aged_out_forgotten_total"] + values["kvmiss_index_aged_out_remembered"] == 89
