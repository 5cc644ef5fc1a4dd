/* Inspect's "why this head attends" panel: the selected query's score on one key, split by rotary frequency pair
   (or by dimension for a position table), drawn as bars, with a sentence naming the deciding parts and the
   content / position split. The data is GET /api/traces/{key}/why/{layer}/{head}?q=&k= (app/viz/why.py). */
(function () {
  "use strict";

  // In a sentence: θ with its unit; under a bar: short (the axis title gives the unit).
  const label = (w, p, tick) => (w.unit === "pair"
    ? kv.t(tick ? "js.why.pair_tick" : "js.why.pair", { p: p.i, theta: p.theta.toPrecision(3) })
    : kv.t("js.why.dim", { p: p.i }));

  async function draw(panel, k) {
    const d = panel.dataset;
    let url = `/api/traces/${d.key}/why/${d.layer}/${d.head}?q=${d.q}`;
    if (k !== "") url += `&k=${k}`;
    const w = await kv.getJSON(url);
    if (!w || !document.body.contains(panel)) return;
    kv.$("why-json").href = url;
    kv.$("why-key").value = k === "" ? "" : String(w.key);
    const pair = w.unit === "pair";
    const deciding = w.deciding.map((i) => label(w, w.parts[i]) + " " + kv.fmt(w.parts[i].value, 3)).join(", ");
    kv.$("why-sentence").textContent = pair
      ? kv.t("js.why.sentence_pair", { q: w.q_pos, k: w.key, token: w.key_token, score: kv.fmt(w.score, 3),
        content: kv.fmt(w.content, 3), position: kv.fmt(w.position, 3), deciding })
      : kv.t("js.why.sentence_dim", { q: w.q_pos, k: w.key, token: w.key_token, score: kv.fmt(w.score, 3),
        n: w.parts.length, deciding });
    const Plotly = await kv.plotlyWhenUsed();  // as the heatmap's: Plotly loads once the reader moves
    const named = new Set(w.deciding);
    const hover = w.parts.map((p) => (pair
      ? kv.t("js.why.hover_pair", { p: p.i, a: p.dims[0], b: p.dims[1], theta: p.theta.toPrecision(4),
        angle: kv.fmt(p.angle, 3), value: kv.fmt(p.value, 4), content: kv.fmt(p.content, 4) })
      : kv.t("js.why.hover_dim", { p: p.i, value: kv.fmt(p.value, 4) })));
    const traces = [{
      type: "bar", x: w.parts.map((p) => label(w, p, true)), y: w.parts.map((p) => p.value),
      marker: { color: w.parts.map((p) => (named.has(p.i) ? "#c2410c" : "#2563eb")) },
      hovertext: hover, hoverinfo: "text", showlegend: false,
    }];
    Plotly.react("why-chart", traces, {
      margin: { l: 70, r: 10, t: 10, b: 150 }, font: kv.plotFont, height: 420,
      xaxis: { title: { text: kv.t(pair ? "js.why.x_pair" : "js.why.x_dim"), standoff: 14 }, tickangle: -60, tickfont: { size: 14 },
        automargin: true },
      yaxis: { title: { text: kv.t("js.why.y") }, zeroline: true },
    }, kv.PLOT_CONFIG);
  }

  kv.page("inspect", (page) => {
    page.view("why-panel", (panel) => {
      const pick = kv.$("why-key");
      pick.addEventListener("change", () => draw(panel, pick.value));
      // After the page's first heatmap: this panel is below it, and its request and Plotly (asked for as soon as
      // the answer came) would share the 2 cores with the first paint, which does not need them.
      if (+document.body.dataset.heatmapDrawn > 0) draw(panel, "");
      else document.body.addEventListener("kv-heatmap", () => draw(panel, ""), { once: true });
    });
  });
})();
