"""The Engine lab's live stream against a pyzmq publisher of vLLM's shape: a batch published reaches the stream as
a line that counts it (the link wakes the stream: no clock to wait for), the line budget merges what comes fast,
and a stream that ends stops being woken. The calculator line on a hybrid model (Gemma 3) against an HTTP stand-in
that prints what vLLM prints for it. (Against a real vLLM: tests/engine/.)"""

from __future__ import annotations

import asyncio
import json
import sys
import threading

from app.engine.metrics import EngineMetrics
from app.labs.engine import EngineLab, EngineLimits
from app.settings import Settings
from tests.engine.frames import stored
from tests.engine.hostile import metrics
from tests.engine.publisher import Publisher, wait_for
from tests.engine.standin import StandIn
from tests.live import in_fresh_thread


def test_a_published_batch_reaches_the_stream_and_a_closed_stream_is_no_longer_woken(tmp_path):
    pub = Publisher()
    settings = Settings(home=tmp_path, engine=("http://127.0.0.1:9",), engine_events=(pub.events,),
                        engine_replay=(pub.replay,), engine_poll_s=30.0, engine_stream_max_s=60.0)
    lab = EngineLab(limits=EngineLimits.of(settings))
    lab.start()
    link = lab.links[0]
    try:
        assert wait_for(lambda: link.events_connected, 10)

        async def follow() -> list[dict]:
            lines = []
            stream = lab.stream(0, "en")
            lines.append(json.loads(await anext(stream)))  # the first line: what the mirror holds now
            assert len(link._watchers) == 1
            for seq in range(5):  # five batches at once: one line or a few, the last counting all five
                pub.publish(seq, [stored([100 + seq], None, range(4))])
            while (lines[-1]["counts"]["next_seq"] or 0) < 5:
                lines.append(json.loads(await asyncio.wait_for(anext(stream), timeout=20)))
            await stream.aclose()
            return lines

        lines = in_fresh_thread(lambda: asyncio.run(follow()))  # no loop of Playwright's on that thread
        assert lines[0]["counts"]["stored"] == 0 and lines[-1]["counts"]["stored"] == 5
        assert {b["hash"] for b in lines[-1]["blocks"]} == {f"{100 + s:016x}" for s in range(5)}
        assert len(lines) <= 1 + 5  # never more than one line per change
        assert not link._watchers  # the closed stream unregistered itself
    finally:
        lab.stop()
        pub.close()


def test_the_calculator_line_on_gemma3_counts_blocks_as_vllm_does(tmp_path):
    """vLLM serving Gemma 3 270M (6 KV-cache groups of 3 layers) prints num_gpu_blocks in blocks of 3 layers' pages:
    the line's own count is that one, and its tokens and concurrency too (a step of 2 048 tokens, the default)."""
    from tests.capacity.vllm_reference import CASES, vllm_figures

    _, _, _, block_size, n, _, mem = CASES["gemma3"]
    vllm = vllm_figures()["gemma3"]
    info = {"block_size": block_size, "cache_dtype": "auto", "kv_cache_memory_bytes": mem,
            "num_gpu_blocks": vllm["num_gpu_blocks"], "kv_cache_size_tokens": vllm["kv_cache_size_tokens"],
            "kv_cache_max_concurrency": vllm["kv_cache_max_concurrency"], "enable_prefix_caching": True}
    labels = ",".join(f'{k}="{v}"' for k, v in info.items())
    engine = StandIn(metrics=f"vllm:cache_config_info{{{labels}}} 1.0\n", model="google/gemma-3-270m",
                     max_model_len=n)
    lab = EngineLab(limits=EngineLimits.of(Settings(home=tmp_path, engine=(engine.url,), engine_poll_s=30.0)))
    lab.start()
    try:
        link = lab.links[0]
        assert wait_for(lambda: link.metrics is not None, 10), lab.status(link, "en")
        line = lab.calculator_line(link)
        assert line["model"] == "Gemma 3 270M"
        assert line["ours"]["num_blocks"] == line["theirs"]["num_blocks"] == 10_922  # not 1 820 pages of 18 layers
        assert (line["groups"], line["group_size"]) == (6, 3)
        assert line["ours"]["tokens"] == line["theirs"]["tokens"]
        # vLLM's float, printed with repr and read back: the same double
        assert line["ours"]["max_concurrency"] == line["theirs"]["max_concurrency"]
    finally:
        lab.stop()
        engine.close()


def test_a_calculator_line_the_engine_says_nonsense_in_is_still_json(tmp_path):
    """A concurrency of NaN (not a figure, and not JSON) is no figure of the engine's; a cache dtype KVScope does not
    know leaves the line empty, said on the page, rather than counted in the wrong bytes."""
    from tests.engine.standin import SMOLLM2_METRICS, StandIn

    engines = [StandIn(metrics=SMOLLM2_METRICS.replace('"22.75"', '"nan"')),
               StandIn(metrics=SMOLLM2_METRICS.replace('"auto"', '"fp4_e2m1"'))]
    lab = EngineLab(limits=EngineLimits.of(Settings(home=tmp_path, engine=tuple(e.url for e in engines),
                                                    engine_poll_s=30.0)))
    lab.start()
    try:
        assert wait_for(lambda: all(link.metrics is not None for link in lab.links), 10)
        nan, unknown = (lab.calculator_line(link) for link in lab.links)
        assert nan["theirs"]["max_concurrency"] is None and nan["ours"]["max_concurrency"] == 22.75
        json.dumps(nan, allow_nan=False)
        assert unknown == {"model": None}
    finally:
        lab.stop()
        for e in engines:
            e.close()


def test_metrics_view_reads_the_log_while_the_http_thread_appends(tmp_path):
    """The HTTP thread appends a scrape to ``metrics_log`` (under the lock) while a page's snapshot reads it: the
    reader copies it under the same lock (before: "deque mutated during iteration")."""
    settings = Settings(home=tmp_path, engine=("http://127.0.0.1:9",), engine_poll_s=30.0)
    lab = EngineLab(limits=EngineLimits.of(settings))  # not started: this test is the HTTP thread
    link = lab.links[0]
    scrape = EngineMetrics.of(metrics())
    link.metrics = scrape
    for _ in range(link.metrics_log.maxlen):
        link.metrics_log.append((0.0, scrape))  # all older than a minute: a view reads the whole log
    stop = threading.Event()

    def append() -> None:
        while not stop.is_set():
            with link.lock:
                link.metrics_log.append((0.0, scrape))

    writer = threading.Thread(target=append)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the GIL changes hands as often as it can: the race shows within a few reads
    writer.start()
    try:
        for _ in range(300):
            assert lab.metrics_view(link)["hit_rate_recent"] == 0.5  # no scrape within the minute: the lifetime
    finally:
        stop.set()
        writer.join()
        sys.setswitchinterval(switch)
