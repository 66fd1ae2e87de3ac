"""Alias: engine images may name kvmiss.enricher.vllm_plugin:register; the plugin is service/vllm_plugin.py."""

from kvmiss.enricher.service.vllm_plugin import register

__all__ = ["register"]
