"""The old import paths kept as aliases (enricher/inprocess.py, enricher/vllm_plugin.py): a router
or an engine image that names them gets the service's own objects."""

from __future__ import annotations

from importlib.metadata import entry_points

from kvmiss.enricher.service import inprocess, vllm_plugin


def test_the_in_process_exporter_keeps_its_old_import_path():
    from kvmiss.enricher.inprocess import MAX_UNDRAINED_BATCHES, EnrichingSpanExporter

    assert EnrichingSpanExporter is inprocess.EnrichingSpanExporter
    assert MAX_UNDRAINED_BATCHES == inprocess.MAX_UNDRAINED_BATCHES


def test_the_vllm_plugin_keeps_its_old_import_path_and_its_entry_point_names_the_new_one():
    from kvmiss.enricher.vllm_plugin import register

    assert register is vllm_plugin.register
    (point,) = [p for p in entry_points(group="vllm.general_plugins") if p.name == "kvmiss"]
    assert point.value == "kvmiss.enricher.service.vllm_plugin:register"
    assert point.load() is vllm_plugin.register
