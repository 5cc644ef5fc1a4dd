"""Every page in Chinese, after a few actions, shows no English sentence outside code, token texts and terms.

"An English sentence" here is three or more English words in a row in visible text, after the intended
terms (names of models, tensors and techniques the reference articles keep in English) are taken out.
"""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.browser

# Terms the Chinese UI keeps in English on purpose (see ZH-TERMS.md): they may stand next to each other.
TERMS = [
    "KV cache", "Hugging Face", "DistilGPT-2", "distilgpt2", "GPT-2", "builtin", "copy-on-write", "causal mask",
    "lm_head", "exp_avg_sq", "exp_avg", "max |Δlogits|", "top-k", "top-p", "softmax", "prefill", "decode",
    "Decode", "Prefill", "token", "query", "key", "value", "block", "cache", "prompt", "head", "head_dim",
    "logits", "attention", "temperature", "greedy", "sample", "fork", "int8", "int4", "fp8", "e4m3", "AdamW",
    "KVScope", "sha256", "salt", "cache salt", "auto", "Q", "K", "V", "LayerNorm", "GELU", "MLP", "wte", "wpe",
    "fp32", "bf16", "float32", "uint8", "JSON", "API", "CPU", "MiB", "KiB", "GiB", "ms", "h0", "c_attn", "c_proj",
    "ln_1", "ln_2", "ln_f", "eviction", "ref_cnt", "optimizer.step", "loss.backward", "grad", "batch", "Python",
    "vLLM", "LRU", "hub", "scores", "weights", "masked", "raw", "lr", "seed", "steps", "batch_size",
    "block_size", "kv_heads", "layers", "bytes", "dtype", "safetensors", "checkpoint", "Linear", "Sigmoid",
]
# Where English is the content itself: code, token texts, prompts, generated text, model output.
SKIP = ("code, pre, script, style, textarea, option, .mono, .tok, .tok-text, .txt, .slot, .slots, .gen, .next, "
        ".token-strip, .blk-tok, .tok-code, .lang-switch, .brand, .model-badge, [data-text], .prompt-text, "
        ".plotly .xtick, .plotly .ytick, .samples, .sample-text")

VISIBLE_TEXT = """(skip) => {
  const out = [];
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    const p = n.parentElement;
    if (!p || p.closest(skip) || !n.textContent.trim()) continue;
    if (!p.getClientRects().length || getComputedStyle(p).visibility === "hidden") continue;
    out.push(n.textContent.trim());
  }
  for (const e of document.querySelectorAll("[title], [aria-label]")) {
    if (e.closest(skip)) continue;
    if (e.title) out.push(e.title);
    if (e.getAttribute("aria-label")) out.push(e.getAttribute("aria-label"));
  }
  return out;
}"""


def english_sentences(texts: list[str]) -> list[str]:
    found = []
    terms = sorted(TERMS, key=len, reverse=True)
    for text in texts:
        t = text
        for term in terms:
            t = re.sub(r"(?<![A-Za-z])" + re.escape(term) + r"(?![A-Za-z])", "·", t)
        # Runs of words and numbers ("seq 0 waits: needs 2 blocks") with three or more English words in them.
        for m in re.finditer(r"(?:[A-Za-z]{2,}|\d+)(?:[\s,:;.()]+(?:[A-Za-z]{2,}|\d+))+", t):
            if len(re.findall(r"[A-Za-z]{2,}", m.group(0))) >= 3:
                found.append(f"{m.group(0)!r} in {text[:120]!r}")
                break
    return found


def check(page) -> None:
    bad = english_sentences(page.evaluate(VISIBLE_TEXT, SKIP))
    assert not bad, "\n".join(bad)
    assert page.js_errors == []


def test_the_detector_finds_english_and_lets_terms_pass():
    assert english_sentences(["未完成： The prompt is empty: type some text first."])
    assert english_sentences(["seq 0 waits: needs 2 blocks, 1 free"])
    assert not english_sentences(["每个 decode 步只输入最新的 token", "KV cache 的字节数", "序列 0 分叉"])


def test_inspect_in_chinese(page, live_server):
    page.goto(live_server + "/?lang=zh&model=builtin&prompt=the+cat+sat")
    page.wait_for_function("document.body.dataset.heatmapDrawn >= '1'")
    page.click("#head-grid .head-cell[data-layer='1'][data-head='2']")
    page.click("#token-strip .tok[data-pos='1']")
    page.wait_for_timeout(500)
    check(page)
    page.fill("#prompt", " ")
    page.click("#run")
    page.wait_for_selector("#error .error-box")
    assert "出错了" in page.inner_text("#error")
    check(page)


def test_decode_in_chinese(page, live_server):
    page.goto(live_server + "/decode?lang=zh&model=builtin")
    page.click("#prefill")
    page.wait_for_function("document.body.dataset.decodeStep === '0'")
    for n in (1, 2):
        page.click("#step")
        page.wait_for_function(f"document.body.dataset.decodeStep === '{n}'")
    page.wait_for_selector("#equiv td.same.ok")
    check(page)


def test_paged_in_chinese(page, live_server):
    page.goto(live_server + "/paged?lang=zh&model=builtin")
    page.wait_for_selector("#pool-map .blk")
    page.fill("#pool-blocks", "4")
    page.click("#pool-reset")
    page.wait_for_function("document.querySelectorAll('#pool-map .blk').length === 4")
    page.fill("#add-prompt", "the cats")
    page.click("#add-seq")
    page.wait_for_selector("#seq-table tr[data-seq='0']")
    page.click("#step")
    page.wait_for_function("document.querySelector('[data-k=step]').textContent === '1'")
    page.click("#seq-table tr[data-seq='0'] button[data-action='fork']")
    page.wait_for_selector("#seq-table tr[data-seq='1']")
    page.fill("#add-prompt", "the cats sat on")
    page.click("#add-seq")
    page.wait_for_selector("#seq-table tr[data-seq='2']")
    for n in range(2, 6):
        page.click("#step")
        page.wait_for_function(f"document.querySelector('[data-k=step]').textContent === '{n}'")
    assert page.locator("#events li").count() >= 5
    page.fill("#bench-prompt", "the cat")
    page.fill("#bench-form input[name=steps]", "3")
    page.click("#bench-run")
    page.wait_for_selector("#bench-table")
    check(page)


def test_prefix_in_chinese(page, live_server):
    page.goto(live_server + "/prefix?lang=zh")
    page.check("input[name=preset][value=timestamp]")
    page.click("#run")
    page.wait_for_selector("#prefix-groups tr[data-group]", timeout=120_000)
    check(page)


def test_head_roles_in_chinese(page, live_server):
    page.goto(live_server + "/heads?lang=zh&model=builtin")
    page.click("#heads-table th[data-col='local'] button")
    page.click("#heads-sequence summary")
    check(page)


def test_train_in_chinese(page, live_server):
    page.goto(live_server + "/train?lang=zh")
    page.wait_for_selector("#loss-plot .main-svg")
    check(page)


def test_the_offline_banner_speaks_chinese(settings, tiny):
    from fastapi.testclient import TestClient

    from app.web.main import create_app
    from tests.conftest import make_state

    why = "DistilGPT-2 is not in the local Hugging Face cache and the hub cannot be reached."
    with TestClient(create_app(state=make_state(settings, tiny, failures={"distilgpt2": why}))) as c:
        html = c.get("/?lang=zh").text
    assert "本地 Hugging Face 缓存里没有 DistilGPT-2" in html and why not in html
