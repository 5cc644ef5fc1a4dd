/* The compression arena's charts: KL per step (every policy), attention mass per layer × head and the kept
   map (one policy, picked in the select). The numbers come from the server in #arena-data. */
(function () {
  "use strict";
  const cfg = { responsive: true, displaylogo: false };
  const font = () => (window.kv && kv.plotFont) || { size: 14 };

  async function draw() {
    const tag = document.getElementById("arena-data");
    if (!tag) return;
    const data = JSON.parse(tag.textContent);
    const Plotly = await kv.plotlyReady();
    const lines = data.policies.filter((p) => p.name !== "full").map((p) => ({
      x: p.kl.map((_, i) => i), y: p.kl, name: p.name, mode: "lines+markers", type: "scatter",
    }));
    Plotly.react("arena-kl", lines, {
      margin: { l: 60, r: 10, t: 10, b: 45 }, font: font(), height: 320,
      xaxis: { title: { text: kv.t("js.arena.step") } }, yaxis: { title: { text: kv.t("js.arena.kl") }, rangemode: "tozero" },
      legend: { font: { size: 12 } },
    }, cfg);
    const pick = document.getElementById("arena-pick");
    const one = () => drawPolicy(Plotly, data, data.policies[Number(pick.value)]);
    pick.onchange = one;
    one();
  }

  function drawPolicy(Plotly, data, p) {
    const layers = [...Array(data.n_layer).keys()].map((l) => "L" + l);
    Plotly.react("arena-mass", [{
      z: p.mass, y: layers, x: [...Array(data.n_head).keys()].map((h) => "H" + h), type: "heatmap",
      zmin: 0, zmax: 1, colorscale: "Viridis", hovertemplate: "%{y} %{x}: %{z:.3f}<extra></extra>",
    }], { margin: { l: 45, r: 10, t: 10, b: 35 }, font: font(), height: 320, yaxis: { autorange: "reversed" } }, cfg);
    const z = p.keep.map((bits) => Array.from(bits, (c) => (c === "1" ? 1 : 0)));
    const n = z.length ? z[0].length : 0;
    const text = p.keep.map(() => data.labels.slice(0, n));
    Plotly.react("arena-keep", [{
      z: z, y: data.map_rows, type: "heatmap", zmin: 0, zmax: 1, showscale: false, text: text,
      colorscale: [[0, "#eef0f3"], [1, "#2f6fdf"]], xgap: n > 200 ? 0 : 1, ygap: 1,
      hovertemplate: "%{y} · pos %{x} %{text}: %{z}<extra></extra>",
    }], {
      margin: { l: 70, r: 10, t: 10, b: 40 }, font: font(), height: Math.max(160, 22 * z.length + 60),
      xaxis: { title: { text: kv.t("js.arena.position") } }, yaxis: { autorange: "reversed" },
    }, cfg);
    const label = document.getElementById("arena-keep-label");
    if (label) label.textContent = p.name;
  }

  /* A new run clears the previous run's error banner (a handler here, not an hx-on attribute: the page's
     Content-Security-Policy allows no inline script). */
  document.addEventListener("htmx:beforeRequest", (e) => {
    const form = e.detail && e.detail.elt;
    if (!form || form.id !== "arena-form") return;
    const box = document.getElementById("error");
    if (box) box.replaceChildren();
  });

  document.addEventListener("DOMContentLoaded", draw);
  document.body && document.body.addEventListener("htmx:afterSwap", (e) => {
    if (e.target && e.target.id === "arena-result") draw();
  });
})();
