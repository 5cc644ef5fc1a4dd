/* /speculative: the rounds are server-rendered (htmx swaps them in). This script draws the roofline from the
   numbers the server put in #roofline-data: log-log, this machine's measured roof, a datasheet GPU's beside it,
   the measured steps and the computed what-ifs. */
window.kv.page("speculative", (page) => {
  "use strict";
  const kv = window.kv;

  async function drawRoofline(result) {
    const tag = result.querySelector("#roofline-data");
    const box = result.querySelector("#roofline-chart");
    if (!tag || !box) return;
    const d = JSON.parse(tag.textContent);
    const Plotly = await kv.plotly();
    const m = d.machine, g = d.gpu;
    const roofLine = (r, name, dash, colour) => ({
      x: r.x, y: r.y, name: name, mode: "lines", type: "scatter", line: { dash: dash, color: colour, width: 3 },
      hovertemplate: "%{x:.2f} FLOP/byte → %{y:.3s} GFLOP/s<extra>" + name + "</extra>",
    });
    const pts = (filter, name, symbol, colour, label) => {
      const p = d.points.filter(filter);
      return {
        x: p.map((q) => q.intensity), y: p.map((q) => q.gflops), name: name, type: "scatter", mode: "markers+text",
        // Points close together (contexts at batch 1) alternate their labels above and below.
        text: p.map(label), textposition: p.map((_, i) => (i % 2 ? "top center" : "bottom center")), textfont: { size: 13 },
        marker: { symbol: symbol, size: 13, color: colour, line: { width: 1, color: "#222" } },
        customdata: p.map((q) => [q.ms, q.gbps, q.of_bandwidth]),
        hovertemplate: "%{x:.2f} FLOP/byte, %{y:.3g} GFLOP/s<br>%{customdata[0]:.1f} ms, %{customdata[1]:.2f} GB/s (×%{customdata[2]:.2f})<extra>" + name + "</extra>",
      };
    };
    const ctx = kv.t("js.roof.context"), bs = kv.t("js.roof.batch_size");
    const traces = [
      roofLine(m, kv.t("js.roof.machine"), "solid", "#2f6fdf"),
      roofLine(g, kv.t("js.roof.gpu"), "dash", "#888"),
      pts((q) => q.phase === "decode" && q.batch === 1, kv.t("js.roof.decode"), "circle", "#d9480f", (q) => ctx + " " + q.context),
      pts((q) => q.phase === "decode" && q.batch > 1, kv.t("js.roof.batch"), "diamond", "#2b8a3e", (q) => bs + " " + q.batch),
      pts((q) => q.phase === "prefill", kv.t("js.roof.prefill"), "square", "#7048e8", (q) => "T=" + q.new_tokens),
    ];
    const wi = d.what_if;
    traces.push({
      x: wi.map((w) => w.intensity), y: wi.map((w) => Math.min(m.peak, m.bandwidth * w.intensity) / 1e9),
      name: wi.length ? wi.map((w) => w.kind).filter((k, i, a) => a.indexOf(k) === i).join(" / ") + " (" + ctx + " " + wi[0].context + ")" : "",
      // Each circle says on the chart which it is (MHA / GQA / MQA and its batch): presenter mode hides the legend.
      type: "scatter", mode: "markers+text", marker: { symbol: "circle-open", size: 11, color: "#555", line: { width: 2 } },
      text: wi.map((w) => w.kind + " ×" + w.batch), textfont: { size: 13, color: "#444" },
      textposition: wi.map((_, i) => (i % 2 ? "top center" : "bottom center")),
      customdata: wi.map((w) => w.kind + ", " + bs + " " + w.batch),
      hovertemplate: "%{customdata}: %{x:.2f} FLOP/byte<extra></extra>",
    });
    const ridge = (r, colour) => ({
      x: Math.log10(r.ridge), y: Math.log10(r.peak / 1e9), xref: "x", yref: "y", text: kv.t("js.roof.ridge") + " " + r.ridge.toFixed(1),
      showarrow: true, arrowhead: 0, ax: 0, ay: -28, font: { size: 13, color: colour },
    });
    Plotly.react(box, traces, {
      font: kv.plotFont, height: 520, margin: { l: 90, r: 20, t: 20, b: 70 },
      xaxis: { type: "log", title: { text: kv.t("js.roof.x") }, range: [Math.log10(d.x_range[0]), Math.log10(d.x_range[1])] },
      yaxis: { type: "log", title: { text: kv.t("js.roof.y") } },
      legend: { orientation: "h", y: -0.18, font: { size: 13 } },
      annotations: [ridge(m, "#2f6fdf"), ridge(g, "#666")],
    }, kv.PLOT_CONFIG);
  }

  page.view("roofline-result", drawRoofline);
});
