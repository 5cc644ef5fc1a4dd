/* Decode studio: prefill, step, run N with stop, cache growth, per-step equivalence check. */
window.kv.page("decode", () => {
  "use strict";
  const kv = window.kv, $ = kv.$;
  let S = null; // {id, last, steps: [], times: []}
  let verifyChain = Promise.resolve();
  let running = false;

  /* What a step's view carries: the selected layer's row, pooled by the server to the plot's width in pixels (a
     long context's row would be every layer × head × position: 8.7 MB of JSON at 6 000 tokens). */
  const plotColumns = () => Math.max(200, ($("attn-heatmap").clientWidth || 900) - 80);
  /* At the model's end token the session stops, unless the learner ticks "go on past the end token". */
  const goOn = () => !!($("go-on") && $("go-on").checked);
  const viewWanted = () => ({ layer: +$("attn-layer").value || 0, width: plotColumns(), go_on: goOn() });
  const blocked = (v) => !v || v.at_limit || (v.ended && !goOn());
  let busyNow = false;

  function setBusy(busy) {
    busyNow = busy;
    $("prefill").disabled = busy;
    $("step").disabled = busy || !S || blocked(S.last);
    $("run").disabled = busy || !S || blocked(S.last);
    $("reset").disabled = busy || !S;
    $("stop").disabled = !running;
  }
  function status(text) { $("status").textContent = text || ""; }

  async function prefill() {
    kv.plotly();  // start loading the charts' library while the server runs the prefill
    kv.clearError();
    await release();
    setBusy(true); status(kv.t("js.decode.prefilling"));
    try {
      const v = await kv.postJSON("/api/decode/sessions", {
        prompt: $("prompt").value, model: $("model").value, mode: $("mode").value,
        temperature: +$("temperature").value, top_k: +$("top_k").value, top_p: +$("top_p").value, seed: +$("seed").value,
        chat: !!($("chat") && $("chat").checked),  // offered only for a model with a chat template
        width: plotColumns(),  // layer 0: the selects are filled for this model once it answers
      });
      S = { id: v.session, last: v, steps: [], rows: [] };
      $("studio").hidden = false;
      $("equiv").querySelector("tbody").textContent = "";
      fillSelects(v);
      show(v);
      const u = v.unknown, note = $("unk-note");  // characters the model cannot represent: say why
      note.hidden = !u;
      if (u) note.textContent = kv.t(u.builtin ? "js.tokens.unknown_builtin" : "js.tokens.unknown_other",
                                     { n: u.count, chars: u.chars, zh: u.zh_chars });
    } catch (e) { /* message shown */ } finally { setBusy(false); status(""); }
  }

  async function step() {
    if (!S) return null;
    try {
      const v = await kv.postJSON(`/api/decode/${S.id}/step`, viewWanted());
      S.last = v;
      show(v);
      return v;
    } catch (e) {
      if (e.status === 410) offerRebuild();
      return null;
    }
  }

  async function run() {
    const n = Math.max(1, +$("run-n").value || 1);
    running = true; setBusy(true);
    for (let i = 0; i < n && running; i++) {
      status(kv.t("js.decode.running", { i: i + 1, n }));
      const v = await step();
      if (blocked(v)) break;
      // Let the browser paint and handle input (a click on Stop) before the next step is sent.
      await new Promise((resolve) => requestAnimationFrame(() => setTimeout(resolve, 0)));
    }
    running = false; setBusy(false); status("");
  }

  async function release() {
    if (S) await kv.forget(`/api/decode/${S.id}`);
  }

  async function reset() {
    running = false;
    await release();
    S = null;
    $("studio").hidden = true;
    setBusy(false); status("");
  }

  function offerRebuild() {
    const area = $("error");
    const b = kv.el("button", { class: "secondary", type: "button" }, kv.t("js.decode.rebuild"));
    const old = S.id;
    b.addEventListener("click", async () => {
      try {
        const v = await kv.postJSON(`/api/decode/${old}/rebuild`, viewWanted());
        S = { id: v.session, last: v, steps: [], rows: [] };
        $("equiv").querySelector("tbody").textContent = "";
        area.textContent = "";
        show(v);
      } catch (e) { /* shown */ }
    });
    area.appendChild(b);
  }

  function fillSelects(v) {
    for (const id of ["attn-layer", "cache-layer"]) {
      const s = $(id); s.textContent = "";
      for (let i = 0; i < v.attention.layers; i++) s.appendChild(kv.el("option", { value: i }, i));
    }
    // The cache holds n_kv_head heads (fewer than the query heads under grouped-query attention).
    const h = $("cache-head"); h.textContent = "";
    for (let i = 0; i < v.attention.kv_heads; i++) h.appendChild(kv.el("option", { value: i }, i));
  }

  function endNote(v) {
    const note = $("end-note");
    if (!note) return;
    note.hidden = !(v && v.ended && !goOn());
    if (!note.hidden) note.textContent = kv.t("js.decode.ended", { token: v.end_token, n: v.tokens.length - v.prompt_len });
  }

  function show(v) {
    endNote(v);
    $("len-badge").textContent = kv.t("js.decode.len_badge", { n: v.tokens.length, cache: v.cache_len });
    const seq = $("seq"); seq.textContent = "";
    v.tokens.forEach((t, i) => {
      const li = kv.el("li", { class: "tok " + (i < v.prompt_len ? "prompt" : "gen") + (i === v.tokens.length - 1 ? " pending" : "") });
      li.appendChild(kv.el("span", { class: "tok-text" }, t));
      li.appendChild(kv.el("span", { class: "tok-pos" }, i));
      seq.appendChild(li);
    });
    const L = v.layers_computed;
    $("step-title").textContent = v.phase === "prefill" ? kv.t("js.decode.title_prefill")
      : kv.t("js.decode.title_step", { i: v.index });
    $("step-explain").textContent = v.phase === "prefill"
      ? kv.t("js.decode.explain_prefill", { n: v.fed.length, layers: L, cache: v.cache_len })
      : kv.t("js.decode.explain_step", { layers: L, past: v.past });
    const facts = $("step-facts"); facts.textContent = "";
    const fed = v.fed.length > 6 ? v.fed.slice(0, 3).map((f) => f.shown).join(" ") + " … " + v.fed.slice(-2).map((f) => f.shown).join(" ") : v.fed.map((f) => f.shown).join(" ");
    for (const [k, val] of [
      ["fed", fed], ["input", `(${v.input_shape.join(", ")})`],
      ["computed", kv.t("js.decode.fact.computed_value", { n: v.fed.length, layers: L })],
      ["read", kv.t("js.decode.fact.read_value", { past: v.past, layers: L })], ["cache_len", v.cache_len],
      ["attn_shape", `(${v.attention.shape.join(", ")})`], ["logits", kv.t("js.decode.fact.logits_value", { n: v.fed.length })],
      ["ms", `${kv.fmt(v.ms, 1)} ms`],
    ]) {
      const tr = kv.el("tr", null); tr.appendChild(kv.el("th", { class: "l" }, kv.t("js.decode.fact." + k))); tr.appendChild(kv.el("td", { class: "l mono" }, val));
      facts.appendChild(tr);
    }
    const tb = $("topk").querySelector("tbody"); tb.textContent = "";
    for (const t of v.top) {
      const tr = kv.el("tr", { class: t.chosen ? "pick" : "" });
      tr.appendChild(kv.el("td", null, t.rank)); tr.appendChild(kv.el("td", { class: "l mono" }, t.shown)); tr.appendChild(kv.el("td", null, t.id));
      tr.appendChild(kv.el("td", null, kv.fmt(t.prob))); tr.appendChild(kv.el("td", null, kv.fmt(t.sample_prob)));
      tr.appendChild(kv.el("td", { class: "l" }, t.chosen ? kv.t("js.decode.chosen") : ""));
      tb.appendChild(tr);
    }
    $("cache-bytes").textContent = kv.t("js.decode.bytes", { n: kv.int(v.cache_bytes) });
    const f = v.formula; // the numbers from the server, the unit in the page's language
    // one term per layer kind (a sliding window's layers hold only its last W - 1 tokens)
    const product = f.kinds.map((k) => [2, k.layers, k.kv_heads, k.tokens, k.head_dim, k.dtype_bytes].join(" · ")).join(" + ");
    $("formula").textContent = kv.t("js.decode.formula", {
      text: product + " = " + kv.t("js.decode.bytes", { n: kv.int(f.total) }) });
    const cs = $("cache-shapes").querySelector("tbody"); cs.textContent = "";
    for (const c of v.cache_shapes) {
      const tr = kv.el("tr", null);
      tr.appendChild(kv.el("td", { class: "l" }, c.layer)); tr.appendChild(kv.el("td", { class: "l mono" }, `(${c.k.join(", ")})`));
      tr.appendChild(kv.el("td", { class: "l mono" }, `(${c.v.join(", ")})`)); tr.appendChild(kv.el("td", null, kv.int(c.bytes)));
      cs.appendChild(tr);
    }
    drawAttention(v);
    drawCacheRows();
    addEquivRow(v);
    drawCost(v);
    document.body.dataset.decodeStep = String(v.index);
  }

  /* The selected layer's row as the server pooled it: column c is the largest weight of positions c·f … c·f+f−1
     (f = 1 up to the plot's width: every position its own column), with the position of that maximum. */
  async function drawAttention(v) {
    await kv.plotly();
    const A = v.attention, H = A.heads, T = A.tokens, n = A.columns, f = A.pool, layer = A.layer;
    const data = kv.b64ToF32(A.data), at = new Int32Array(kv.b64ToBytes(A.at).buffer);
    const z = [], custom = [];
    for (let h = 0; h < H; h++) {
      z.push(Array.from(data.subarray(h * n, (h + 1) * n)));
      const cr = [];
      for (let c = 0; c < n; c++) cr.push([c * f, Math.min(T, (c + 1) * f) - 1, at[h * n + c]]);
      custom.push(cr);
    }
    const x = [...Array(n).keys()].map((c) => c * f);
    S.attn = { layer, custom };
    cellWanted = "";
    $("attn-cell").textContent = cellHint;  // a new row: the last hovered cell's weight was another step's
    $("attn-shape").textContent = kv.t("js.decode.attn_shape", { layer, heads: H, tokens: T }) +
      (f > 1 ? " · " + kv.t("js.decode.attn_pooled", { f }) : "");
    document.body.dataset.decodeAttnPool = String(f);
    const box = $("attn-heatmap");
    await Plotly.react(box, [{
      type: "heatmap", z, colorscale: kv.WEIGHT_SCALE, zmin: 0, zmax: 1,
      x, y: [...Array(H).keys()], customdata: custom,
      hovertemplate: (f === 1 ? kv.t("js.decode.hover_attn", { h: "%{y}", p: "%{x}" }) + "<br>" + kv.t("js.kind.weights") +
        " = %{z:.6f}" : kv.t("js.decode.hover_attn_pooled", { h: "%{y}", a: "%{customdata[0]}", b: "%{customdata[1]}", p: "%{customdata[2]}", w: "%{z:.6f}" })) + "<extra></extra>",
      colorbar: { title: { text: kv.t("js.kind.weights") } },
    }], {
      margin: { l: 60, r: 10, t: 10, b: 50 }, font: kv.plotFont,
      xaxis: { title: { text: kv.t("js.decode.axis_position_key") } },
      yaxis: { title: { text: kv.t("js.decode.axis_head") }, autorange: "reversed", dtick: 1 },
    }, kv.PLOT_CONFIG);
    if (!box.dataset.hoverBound) {  // once per plot: Plotly keeps its handlers across react()
      box.dataset.hoverBound = "1";
      box.on("plotly_hover", (e) => { const p = e.points && e.points[0]; if (p) showCell(p.y, p.pointNumber[1]); });
    }
  }

  /* The hovered column's largest weight, exact, with its key's token: asked of the server (the cell endpoint), the
     newest request winning. */
  let cellWanted = "";
  const cellHint = $("attn-cell").textContent;
  async function showCell(head, col) {
    if (!S || !S.attn || !S.attn.custom[head] || !S.attn.custom[head][col]) return;
    const pos = S.attn.custom[head][col][2], layer = S.attn.layer;
    const url = `/api/decode/${S.id}/cell/${layer}/${head}/${pos}`;
    if (url === cellWanted) return;
    cellWanted = url;
    let c;
    try { c = await kv.getJSON(url); } catch (e) { return; }
    if (url !== cellWanted) return;
    $("attn-cell").textContent = kv.t("js.decode.cell", { layer: c.layer, h: c.head, p: c.pos, token: c.token,
                                                         w: c.weight.toPrecision(9) });
  }

  async function changeLayer() {
    if (!S) return;
    const want = viewWanted();
    let a;
    try { a = await kv.getJSON(`/api/decode/${S.id}/row/${want.layer}?width=${want.width}`); } catch (e) { return; }
    if (+$("attn-layer").value !== a.layer) return;  // another layer was chosen meanwhile
    S.last.attention = a;
    drawAttention(S.last);
  }

  async function drawCacheRows() {
    if (!S) return;
    const layer = +$("cache-layer").value || 0, head = +$("cache-head").value || 0;
    const which = $("cache-kv").value === "v" ? "v" : "k";
    let c;
    try { c = await kv.getJSON(`/api/decode/${S.id}/cache/${layer}/${head}?last=24`); } catch (e) { return; }
    await kv.plotly();
    const k = kv.b64ToF32(c[which]), n = c.total - c.start, d = c.head_dim;
    const name = which.toUpperCase();
    const z = [];
    for (let i = 0; i < n; i++) z.push(Array.from(k.subarray(i * d, (i + 1) * d)));
    const y = [...Array(n).keys()].map((i) => c.start + i);
    Plotly.react("cache-rows", [{
      type: "heatmap", z, y, x: [...Array(d).keys()], colorscale: "RdBu", zmid: 0,
      hovertemplate: "%{y}, %{x}<br>" + name + " = %{z:.4f}<extra></extra>",
      colorbar: { title: { text: kv.t("js.decode.kv_value", { kv: name }) } },
    }], {
      margin: { l: 60, r: 10, t: 30, b: 50 }, font: kv.plotFont,
      title: { text: kv.t("js.decode.kv_rows_title", { kv: name, layer, head, shape: c.k_shape.join(", ") }),
        font: { size: 14 } },
      xaxis: { title: { text: kv.t("js.decode.axis_head_dim") } },
      yaxis: { title: { text: kv.t("js.decode.axis_position") }, autorange: "reversed" },
      shapes: [{ type: "rect", xref: "paper", x0: 0, x1: 1, y0: c.total - 1.5, y1: c.total - 0.5, line: { color: "#e39b00", width: 3 } }],
    }, kv.PLOT_CONFIG);
  }

  async function addEquivRow(v) {
    const tr = kv.el("tr", null);
    tr.dataset.step = v.index;
    const fed = v.fed.length > 3 ? kv.t("js.decode.prompt_tokens", { n: v.fed.length }) : v.fed.map((f) => f.shown).join(" ");
    for (const [val, cls] of [[v.index], [fed, "l mono"], [`(${v.input_shape.join(", ")})`], [v.cache_len],
      [v.chosen.shown, "l mono"], [kv.fmt(v.chosen.prob)], ["…", "diff"], ["…", "same"], [kv.fmt(v.ms, 1)], ["…", "full"]]) {
      tr.appendChild(kv.el("td", { class: cls }, val));
    }
    // Keep the newest row in view inside the table's own box; the page itself never scrolls (Stop stays put).
    const box = $("equiv-scroll");
    const atEnd = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    $("equiv").querySelector("tbody").appendChild(tr);
    if (atEnd && !document.body.classList.contains("present")) box.scrollTop = box.scrollHeight;  // presenter: no auto-scroll
    let r;
    // One check at a time per page: a long Run would otherwise queue dozens of full recomputes at once,
    // and the server admits only a few waiting requests per browser.
    const sid = S.id;
    const turn = (verifyChain = verifyChain.then(() => kv.getJSON(`/api/decode/${sid}/verify/${v.index}`)));
    verifyChain = turn.catch(() => null);
    try { r = await turn; } catch (e) { return; }
    tr.querySelector(".diff").textContent = r.max_abs_diff.toExponential(2);
    const same = tr.querySelector(".same");
    same.textContent = kv.t(r.same_token ? "js.decode.same_yes" : "js.decode.same_no");
    same.className = r.same_token ? "same ok" : "same bad";
    tr.querySelector(".full").textContent = kv.fmt(r.recompute_ms, 1);
    S.steps.push(r);
    const worst = Math.max(...S.steps.map((s) => s.max_abs_diff));
    const allSame = S.steps.every((s) => s.same_token);
    const sum = $("equiv-summary");
    // What the measured size means, from the number itself (fp32: ~7 significant digits on logits of 10-30).
    const why = kv.t(worst < 1e-4 ? "js.decode.diff.rounding" : worst < 1e-3 ? "js.decode.diff.roundings" : "js.decode.diff.more");
    sum.textContent = kv.t("js.decode.summary", { n: S.steps.length, diff: worst.toExponential(2), why,
      verdict: kv.t(allSame ? "js.decode.same_tokens" : "js.decode.tokens_differ") });
    sum.className = "pill " + (allSame && worst < 1e-3 ? "ok" : "bad");
    drawTimes();
  }

  async function drawCost(v) {
    await kv.plotly();
    const w = v.work, x = [...Array(w.tokens_cached.length).keys()];
    const lay = (yt) => ({ margin: { l: 80, r: 10, t: 10, b: 50 }, font: kv.plotFont,
      xaxis: { title: { text: kv.t("js.decode.axis_generated") }, dtick: x.length < 12 ? 1 : undefined },
      yaxis: { title: { text: yt } }, legend: { orientation: "h", y: 1.12 } });
    Plotly.react("cost-tokens", [
      { x, y: w.tokens_recompute, name: kv.t("js.decode.series_tokens_full"), mode: "lines+markers" },
      { x, y: w.tokens_cached, name: kv.t("js.decode.series_tokens_cached"), mode: "lines+markers" },
    ], lay(kv.t("js.decode.axis_tokens")), kv.PLOT_CONFIG);
    Plotly.react("cost-pairs", [
      { x, y: w.pairs_recompute, name: kv.t("js.decode.series_pairs_full"), mode: "lines+markers" },
      { x, y: w.pairs_cached, name: kv.t("js.decode.series_pairs_cached"), mode: "lines+markers" },
    ], lay(kv.t("js.decode.axis_pairs")), kv.PLOT_CONFIG);
  }

  async function drawTimes() {
    await kv.plotly();
    const x = S.steps.map((s) => s.index);
    Plotly.react("cost-time", [
      { x, y: S.steps.map((s) => s.recompute_ms), name: kv.t("js.decode.series_time_full"), mode: "lines+markers" },
      { x, y: S.steps.map((s) => s.cached_ms), name: kv.t("js.decode.series_time_cached"), mode: "lines+markers" },
    ], { margin: { l: 80, r: 10, t: 10, b: 50 }, font: kv.plotFont, legend: { orientation: "h", y: 1.12 },
      xaxis: { title: { text: kv.t("js.decode.axis_step") } }, yaxis: { title: { text: kv.t("js.decode.axis_ms") } } },
    kv.PLOT_CONFIG);
  }

  /* Temperature, top-k, top-p and the seed only matter when sampling: greedy mode turns them off. */
  function syncMode() {
    const greedy = $("mode").value === "greedy";
    for (const id of ["temperature", "top_k", "top_p", "seed"]) $(id).disabled = greedy;
  }

  syncMode();
  $("mode").addEventListener("change", syncMode);
  if ($("go-on")) $("go-on").addEventListener("change", () => { if (!busyNow) setBusy(false); if (S) endNote(S.last); });
  $("prefill").addEventListener("click", prefill);
  $("step").addEventListener("click", async () => { setBusy(true); await step(); setBusy(false); });
  $("run").addEventListener("click", run);
  // Stop: no new step starts; the one in flight finishes, then run() re-enables the buttons.
  $("stop").addEventListener("click", () => { running = false; $("stop").disabled = true; });
  $("reset").addEventListener("click", reset);
  $("attn-layer").addEventListener("change", changeLayer);
  $("cache-layer").addEventListener("change", drawCacheRows);
  $("cache-head").addEventListener("change", drawCacheRows);
  $("cache-kv").addEventListener("change", drawCacheRows);
  window.addEventListener("pagehide", () => { if (S) navigator.sendBeacon(`/api/decode/${S.id}/close`); });
});
