/* Inspect page: the all-heads grid, one head's heatmap, the selected row, and URL state. */
(function () {
  "use strict";
  const kv = window.kv;
  let S = null; // current view state

  function labels() {
    const el = document.getElementById("token-labels");
    return el ? JSON.parse(el.textContent) : [];
  }

  function init() {
    const root = document.getElementById("inspect-view");
    if (!root) return;
    S = {
      key: root.dataset.key, T: +root.dataset.tokens, L: +root.dataset.layers, H: +root.dataset.heads,
      layer: +root.dataset.layer, head: +root.dataset.head, q: +root.dataset.q, kind: root.dataset.kind,
      labels: labels(), matrix: null,
    };
    document.querySelectorAll("#token-strip .tok").forEach((el) => {
      el.addEventListener("click", () => select({ q: +el.dataset.pos }));
      el.addEventListener("keydown", (e) => { if (e.key === "Enter") select({ q: +el.dataset.pos }); });
    });
    document.getElementById("sel-layer").addEventListener("change", (e) => select({ layer: +e.target.value }));
    document.getElementById("sel-head").addEventListener("change", (e) => select({ head: +e.target.value }));
    document.querySelectorAll("input[name=kind]").forEach((el) =>
      el.addEventListener("change", (e) => select({ kind: e.target.value })));
    markToken();
    drawGrid();
    drawHead();
  }

  function syncUrl() {
    const u = new URL(window.location.href);
    u.searchParams.set("layer", S.layer);
    u.searchParams.set("head", S.head);
    u.searchParams.set("q", S.q);
    u.searchParams.set("kind", S.kind);
    window.history.replaceState(null, "", u.toString());
  }

  function select(change) {
    const before = Object.assign({}, S);
    Object.assign(S, change);
    document.getElementById("sel-layer").value = S.layer;
    document.getElementById("sel-head").value = S.head;
    syncUrl();
    markToken();
    markGrid();
    if (S.layer !== before.layer || S.head !== before.head || S.kind !== before.kind) drawHead();
    else drawRow();
    if (S.layer !== before.layer || S.head !== before.head || S.q !== before.q) {
      htmx.ajax("GET", `/inspect/${S.key}/query?layer=${S.layer}&head=${S.head}&q=${S.q}`, "#query-panels");
    }
  }

  function markToken() {
    document.querySelectorAll("#token-strip .tok").forEach((el) => el.classList.toggle("sel", +el.dataset.pos === S.q));
  }

  async function drawGrid() {
    const g = await kv.getJSON(`/api/traces/${S.key}/grid`);
    const bytes = kv.b64ToBytes(g.data);
    const box = document.getElementById("head-grid");
    box.textContent = "";
    const n = g.side * g.side;
    const label = (text) => { const d = document.createElement("div"); d.className = "lbl"; d.textContent = text; return d; };
    box.appendChild(label(""));
    for (let h = 0; h < g.n_head; h++) box.appendChild(label("h" + h));
    for (let l = 0; l < g.n_layer; l++) {
      box.appendChild(label("L" + l));
      for (let h = 0; h < g.n_head; h++) {
        const c = document.createElement("canvas");
        c.width = g.side; c.height = g.side;
        c.dataset.layer = l; c.dataset.head = h;
        c.title = kv.t("js.inspect.grid_cell", { layer: l, head: h });
        const ctx = c.getContext("2d");
        const img = ctx.createImageData(g.side, g.side);
        const off = (l * g.n_head + h) * n;
        for (let i = 0; i < n; i++) {
          const v = bytes[off + i];
          img.data[4 * i] = 255 - Math.round(v * 0.85);
          img.data[4 * i + 1] = 255 - Math.round(v * 0.62);
          img.data[4 * i + 2] = 255 - Math.round(v * 0.25);
          img.data[4 * i + 3] = 255;
        }
        ctx.putImageData(img, 0, 0);
        c.addEventListener("click", () => select({ layer: l, head: h }));
        box.appendChild(c);
      }
    }
    markGrid();
    document.body.dataset.gridDrawn = "1";
  }

  function markGrid() {
    document.querySelectorAll("#head-grid canvas").forEach((c) =>
      c.classList.toggle("sel", +c.dataset.layer === S.layer && +c.dataset.head === S.head));
  }

  /* Unpack the server's matrix into rows; null marks cells the causal mask hides. */
  function unpack(m) {
    const vals = kv.b64ToF32(m.data);
    const z = [];
    let k = 0;
    for (let i = 0; i < m.rows; i++) {
      const row = new Array(m.cols);
      const visible = m.packing === "lower" ? m.past + i + 1 : m.cols;
      for (let j = 0; j < m.cols; j++) row[j] = j < visible ? vals[k++] : null;
      z.push(row);
    }
    return z;
  }

  const title = (kind) => kv.t("js.kind." + kind);

  async function drawHead() {
    const want = `${S.layer}/${S.head}/${S.kind}`;
    const m = await kv.getJSON(`/api/traces/${S.key}/attention/${S.layer}/${S.head}?kind=${S.kind}`);
    if (want !== `${S.layer}/${S.head}/${S.kind}`) return; // a newer selection is on its way
    const z = unpack(m);
    S.matrix = { z, kind: m.kind };
    await kv.plotlyReady();
    const idx = [...Array(m.cols).keys()];
    const small = m.cols <= 32; // token labels on the axes only while they fit
    const ticks = small ? { tickvals: idx, ticktext: idx.map((i) => S.labels[i]) } : {};
    const trace = {
      type: "heatmap", z, x: idx, y: idx.slice(0, m.rows),
      colorscale: m.kind === "weights" ? kv.WEIGHT_SCALE : "RdBu", reversescale: m.kind !== "weights",
      zmin: m.kind === "weights" ? 0 : undefined, zmax: m.kind === "weights" ? 1 : undefined,
      zmid: m.kind === "weights" ? undefined : 0,
      hoverongaps: false,
      colorbar: { title: { text: title(m.kind), side: "right" } },
      hovertemplate: kv.t("js.inspect.hover_cell", { q: "%{y}", k: "%{x}" }) + "<br>" + title(m.kind) +
        " = %{z:.6f}<extra></extra>",
    };
    if (m.cols <= 256) { // name the tokens on hover (skipped for long prompts: the payload grows as T²)
      trace.customdata = z.map((row, i) => row.map((_, j) => [S.labels[i], S.labels[j]]));
      trace.hovertemplate = kv.t("js.inspect.hover_cell", { q: "%{y} %{customdata[0]}", k: "%{x} %{customdata[1]}" }) +
        "<br>" + title(m.kind) + " = %{z:.6f}<extra></extra>";
    }
    const layout = {
      margin: { l: small ? 90 : 60, r: 10, t: 10, b: small ? 90 : 55 }, font: kv.plotFont,
      plot_bgcolor: kv.MASK_COLOUR, // cells left empty (null) are the masked future
      xaxis: Object.assign({ title: { text: kv.t("js.inspect.axis_key") }, tickangle: small ? -60 : 0 }, ticks),
      yaxis: Object.assign({ title: { text: kv.t("js.inspect.axis_query") }, autorange: "reversed" }, ticks),
    };
    await Plotly.react("heatmap", [trace], layout, { responsive: true, displaylogo: false });
    const el = document.getElementById("heatmap");
    el.removeAllListeners && el.removeAllListeners("plotly_click");
    el.on("plotly_click", (ev) => { if (ev.points && ev.points.length) select({ q: ev.points[0].y }); });
    document.getElementById("head-label").textContent =
      kv.t("js.inspect.head_label", { layer: S.layer, head: S.head, rows: m.rows, cols: m.cols });
    document.body.dataset.heatmapDrawn = String((+document.body.dataset.heatmapDrawn || 0) + 1);
    drawRow();
  }

  function drawRow() {
    if (!S.matrix || !window.Plotly) return; // drawHead draws the row once Plotly has loaded
    const row = S.matrix.z[S.q] || [];
    const n = S.q + 1; // keys the query may read
    const x = [...Array(n).keys()];
    const y = row.slice(0, n);
    const small = n <= 48;
    Plotly.react("row-chart", [{
      type: "bar", x, y, marker: { color: "#3a72c4" },
      hovertemplate: kv.t("js.inspect.hover_key", { k: "%{x}" }) + "<br>" + title(S.matrix.kind) +
        " = %{y:.6f}<extra></extra>",
    }], {
      margin: { l: 70, r: 10, t: 10, b: small ? 90 : 50 }, font: kv.plotFont,
      xaxis: Object.assign({ title: { text: kv.t("js.inspect.axis_key_short") } },
        small ? { tickvals: x, ticktext: x.map((i) => S.labels[i]), tickangle: -60 } : {}),
      yaxis: { title: { text: title(S.matrix.kind) } },
    }, { responsive: true, displaylogo: false });
    document.getElementById("row-label").textContent =
      kv.t("js.inspect.row_label", { q: S.q, token: S.labels[S.q] || "", layer: S.layer, head: S.head });
  }

  document.addEventListener("DOMContentLoaded", init);
  document.addEventListener("htmx:afterSwap", (e) => { if (e.target.id === "result") init(); });
})();
