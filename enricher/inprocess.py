"""Alias: routers import the in-process exporter from here; it lives in service/inprocess.py."""

from kvmiss.enricher.service.inprocess import MAX_UNDRAINED_BATCHES, EnrichingSpanExporter

__all__ = ["EnrichingSpanExporter", "MAX_UNDRAINED_BATCHES"]
