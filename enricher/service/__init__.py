"""The service: the pipeline that joins the OTLP edge to the core (pipeline.py), `kvmiss serve`
(serve.py), its metrics and the collector-to-index hand-over; the same pipeline in a Python
router (inprocess.py), offline (offline.py) and inside vLLM (vllm_plugin.py)."""
