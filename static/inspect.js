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
      KV: +root.dataset.kvHeads || +root.dataset.heads, labels: labels(), matrix: null, grid: null,
      cached: +root.dataset.cachedKeys || 0,  // a served request's keys read from the engine's cached blocks
      scale: new URL(window.location.href).searchParams.get("scale") || "sqrt",
      ...multiFromUrl(+root.dataset.tokens),
    };
    // The layers this page drew while its prompt was captured (climb.js): the same bytes the server would send.
    S.climb = kv.climb && kv.climb.key === S.key && kv.climb.done ? kv.climb : null;
    const scale = document.getElementById("sel-scale");
    if (!kv.SCALES[S.scale]) S.scale = "sqrt";
    scale.value = S.scale;
    scale.addEventListener("change", (e) => { S.scale = e.target.value; syncUrl(); paintGrid(); drawHead(); });
    // A click picks one token; Shift/Ctrl/⌘ + click (or + Enter) adds it to the tokens summed, or takes it out.
    // On a phone (no Shift key) the "pick several" box makes every tap add or remove.
    const several = document.getElementById("multi-pick");
    const adding = (e) => e.shiftKey || e.ctrlKey || e.metaKey || (several && several.checked);
    // One listener on the strip, not two on each of its tokens.
    const strip = document.getElementById("token-strip");
    const chip = (e) => e.target.closest && e.target.closest("#token-strip .tok");
    if (strip) {
      strip.addEventListener("click", (e) => { const el = chip(e); if (el) pick(+el.dataset.pos, adding(e)); });
      strip.addEventListener("keydown", (e) => {
        const el = chip(e);
        if (el && (e.key === "Enter" || e.key === " ")) { e.preventDefault(); pick(+el.dataset.pos, adding(e)); }
      });
    }
    initMulti();
    document.getElementById("grid-sinks").addEventListener("change", toggleSinks);
    // The strip is one tab stop (a listbox): the arrow keys move the selected token, as a click does.
    if (strip) kv.rovingKeys(strip, ".tok", { onMove: (el) => select({ q: +el.dataset.pos }) });
    document.getElementById("sel-layer").addEventListener("change", (e) => select({ layer: +e.target.value }));
    document.getElementById("sel-head").addEventListener("change", (e) => select({ head: +e.target.value }));
    document.querySelectorAll("input[name=kind]").forEach((el) =>
      el.addEventListener("change", (e) => select({ kind: e.target.value })));
    markToken();
    // The grid after the first heatmap: its request (every head's weights, pooled) would share the server's and the
    // browser's CPU with the first paint, which does not need it.
    const mine = S;
    if (climbGrid()) drawGrid();  // already drawn while the capture ran: shown again at once, not blanked
    else document.body.addEventListener("kv-heatmap", () => { if (S === mine) drawGrid(); }, { once: true });
    // A head the learner clicked while the layers came in is the one the view opens on.
    const picked = S.climb && S.climb.picked;
    if (picked) S.climb.picked = null;  // once: a later swap of the same prompt opens on its own head
    if (picked && (picked.layer !== S.layer || picked.head !== S.head)) select(picked);
    else drawHead();
  }

  /* The all-heads grid as the climb received it, every layer in (null otherwise). */
  function climbGrid() {
    const c = S.climb;
    if (!c || Object.keys(c.layers).length !== S.L) return null;
    const n = S.H * c.side * c.side, bytes = new Uint8Array(S.L * n);
    for (let l = 0; l < S.L; l++) bytes.set(c.layers[l], l * n);
    return { n_layer: S.L, n_head: S.H, side: c.side, gamma: 0.5, bytes };
  }

  function syncUrl() {
    const u = new URL(window.location.href);
    u.searchParams.set("layer", S.layer);
    u.searchParams.set("head", S.head);
    u.searchParams.set("q", S.q);
    u.searchParams.set("kind", S.kind);
    u.searchParams.set("scale", S.scale);
    if (S.multi.length) {
      u.searchParams.set("sum", S.multi.join(","));
      u.searchParams.set("over", S.over);
      u.searchParams.set("agg", S.agg);
    } else ["sum", "over", "agg"].forEach((k) => u.searchParams.delete(k));
    window.history.replaceState(null, "", u.toString());
  }

  function select(change) {
    const before = Object.assign({}, S);
    Object.assign(S, change);
    const why = document.getElementById("head-choice"); // why the page opened on its first head: not this one's
    if (why && (S.layer !== before.layer || S.head !== before.head)) why.hidden = true;
    document.getElementById("sel-layer").value = S.layer;
    document.getElementById("sel-head").value = S.head;
    syncUrl();
    markToken();
    markGrid();
    const url = `/inspect/${S.key}/query?layer=${S.layer}&head=${S.head}&q=${S.q}`;
    const panels = S.layer !== before.layer || S.head !== before.head || S.q !== before.q;
    if (panels) S.panelsWanted = url;
    const loadPanels = () => { if (panels && url === S.panelsWanted) htmx.ajax("GET", url, "#query-panels"); };
    if (S.layer !== before.layer || S.head !== before.head || S.kind !== before.kind) {
      // The heatmap first, then the panels below it (on 2 cores the two requests would share the CPU and
      // both arrive late). A newer selection made meanwhile asks for its own panels.
      drawHead().finally(loadPanels);
    } else {
      drawRow();
      loadPanels();
    }
  }

  /* Mark the selected one of ``items`` and unmark the others, touching only elements whose state changes (a
     512-token strip rewritten on every click cost the browser a style pass over every token). */
  function markOne(items, isOn, attr) {
    items.forEach((el) => {
      const on = isOn(el);
      if (el.classList.contains("sel") === on && el.hasAttribute(attr)) return;
      el.classList.toggle("sel", on);
      el.setAttribute(attr, on ? "true" : "false");
      el.setAttribute("tabindex", on ? "0" : "-1");
    });
  }

  function markToken() {
    const tokens = document.querySelectorAll("#token-strip .tok"), summed = new Set(S.multi);
    markOne(tokens, (el) => +el.dataset.pos === S.q, "aria-selected");
    tokens.forEach((el) => {
      const on = summed.has(+el.dataset.pos);
      if (el.classList.contains("in-sum") !== on) el.classList.toggle("in-sum", on);
      if (on) el.setAttribute("aria-selected", "true");  // the strip is a multi-select listbox while tokens are summed
    });
    const strip = document.getElementById("token-strip"), on = strip && strip.querySelector(".tok.sel");
    if (on) showInStrip(strip, on);
  }

  /* The chosen token in sight inside the strip's own scroll box (a click on the heatmap or a shared link may choose
     one out of sight); the page itself does not move. */
  function showInStrip(strip, el) {
    const box = strip.getBoundingClientRect(), r = el.getBoundingClientRect();
    if (r.top < box.top) strip.scrollTop -= box.top - r.top + 4;
    else if (r.bottom > box.bottom) strip.scrollTop += r.bottom - box.bottom + 4;
  }

  /* Query head h reads KV head h // (n_head / n_kv_head): heads sharing one KV head form a group (GPT-2: groups of one). */
  const kvGroup = (h) => Math.floor(h / (S.H / S.KV));
  const GROUP_COLOURS = ["#1f5fbf", "#d08a00", "#1c8a4a", "#a4001d", "#6a3fb5", "#008b8b", "#8a4b00", "#c2185b"];

  async function drawGrid() {
    const url = `/api/traces/${S.key}/grid`, mine = S, climbed = climbGrid();
    const g = climbed || await kv.getJSON(url);
    S.grid = g;
    if (!climbed) S.grid.bytes = kv.b64ToBytes(g.data);
    else {  // the sink view's shares come with the server's grid (its cells are the bytes drawn already)
      kv.getJSON(url).then((full) => { if (S === mine) S.grid = Object.assign(full, { bytes: g.bytes }); });
    }
    const box = document.getElementById("head-grid");
    box.textContent = "";
    const label = (content, cls) => kv.el("div", { class: "lbl" + (cls ? " " + cls : "") }, ...[].concat(content));
    const grouped = S.KV < S.H;
    // Column labels are numbers, one per line: the query head, then (grouped-query attention) the KV head it
    // reads. The corner names the lines ("h", "kv"), so a label stays as narrow as its number ("h10·kv1" ran
    // into its neighbours at 14 heads).
    const lines = (...parts) => parts.map((p) => kv.el("span", null, String(p)));
    const corner = label(lines("h", ...(grouped ? ["kv"] : [])), "corner");
    corner.title = kv.t(grouped ? "js.inspect.grid_corner_kv" : "js.inspect.grid_corner");
    box.appendChild(corner);
    for (let h = 0; h < g.n_head; h++) {
      const d = label(lines(h, ...(grouped ? [kvGroup(h)] : [])), "group");
      d.style.borderBottomColor = GROUP_COLOURS[kvGroup(h) % GROUP_COLOURS.length];
      d.title = kv.t("js.inspect.kv_group", { head: h, kv: kvGroup(h) });
      box.appendChild(d);
    }
    for (let l = 0; l < g.n_layer; l++) {
      box.appendChild(label("L" + l));
      for (let h = 0; h < g.n_head; h++) {
        const name = kv.t("js.inspect.grid_cell", { layer: l, head: h }) + (grouped ? " · kv " + kvGroup(h) : "");
        // A cell showing its part of one picture of all heads (paintSprite), not a canvas per head: 72+ canvases
        // are as many compositor layers, which made the page's first frames slow (Lighthouse counted 0.6 s of
        // blocking time on a throttled phone).
        const c = kv.el("div", { class: "head-cell", "data-layer": l, "data-head": h, title: name,
          role: "button", "aria-label": name, tabindex: -1 });
        c.addEventListener("click", () => select({ layer: l, head: h }));
        c.addEventListener("keydown", (e) => {
          if (e.key === "Enter" || e.key === " ") { e.preventDefault(); select({ layer: l, head: h }); }
        });
        box.appendChild(c);
      }
    }
    // One tab stop for the whole grid: the arrow keys move between heads, Enter or Space shows one.
    if (!box.dataset.kvKeys) {
      box.dataset.kvKeys = "1";
      kv.rovingKeys(box, ".head-cell", { cols: () => S.H });
    }
    paintGrid();
    markGrid();
    document.body.dataset.gridDrawn = "1";
  }

  /* The grid's pixels in the chosen colour scale, so the grid and the big map agree. The server sends
     round(255·√w) (kv.fromSqrtU8); the weight is recovered, then scaled like the heatmap's colours. */
  function paintGrid() {
    const g = S.grid;
    if (!g) return;
    const sinks = document.getElementById("grid-sinks");
    if (sinks && sinks.checked && g.sink_share) return paintSinks();
    const n = g.side * g.side, f = kv.SCALES[S.scale].f, lut = new Uint8ClampedArray(256 * 3);
    for (let v = 0; v < 256; v++) {
      const [r, gg, b] = kv.weightColour(f(kv.fromSqrtU8(v)));
      lut[3 * v] = r; lut[3 * v + 1] = gg; lut[3 * v + 2] = b;
    }
    const sprite = kv.el("canvas", { width: g.side * g.n_head, height: g.side * g.n_layer });
    const ctx = sprite.getContext("2d"), img = ctx.createImageData(g.side, g.side);
    for (let l = 0; l < g.n_layer; l++) {
      for (let h = 0; h < g.n_head; h++) {
        const off = (l * g.n_head + h) * n;
        for (let i = 0; i < n; i++) {
          const v = g.bytes[off + i];
          img.data[4 * i] = lut[3 * v]; img.data[4 * i + 1] = lut[3 * v + 1]; img.data[4 * i + 2] = lut[3 * v + 2];
          img.data[4 * i + 3] = 255;
        }
        ctx.putImageData(img, h * g.side, l * g.side);
      }
    }
    paintSprite(sprite);
  }

  /* One picture of every head (layer l, head h in the tile at row l, column h) shown by the cells, each
     its own tile. The picture is encoded off the page's main work (toBlob) and replaces the previous one. */
  let spriteUrl = null, spriteVersion = 0;  // the page's one picture, across prompts (S is made anew for each)
  function paintSprite(sprite) {
    const g = S.grid, version = ++spriteVersion;
    sprite.toBlob((blob) => {
      if (!blob || version !== spriteVersion) return;
      if (spriteUrl) URL.revokeObjectURL(spriteUrl);
      spriteUrl = URL.createObjectURL(blob);
      const at = (i, n) => (n > 1 ? (100 * i) / (n - 1) : 0) + "%";
      document.querySelectorAll("#head-grid .head-cell").forEach((c) => {
        c.style.backgroundImage = `url(${spriteUrl})`;
        c.style.backgroundSize = `${g.n_head * 100}% ${g.n_layer * 100}%`;
        c.style.backgroundPosition = `${at(+c.dataset.head, g.n_head)} ${at(+c.dataset.layer, g.n_layer)}`;
      });
      document.body.dataset.gridPainted = String(version);
    });
  }

  /* The sink view of the grid: each head as one colour, its share of attention on token 0, printed in it. */
  function paintSinks() {
    const g = S.grid, px = 128, f = kv.SCALES[S.scale].f;
    document.getElementById("head-grid").classList.add("sinks");
    const sprite = kv.el("canvas", { width: px * g.n_head, height: px * g.n_layer }), ctx = sprite.getContext("2d");
    ctx.font = "bold 40px system-ui, sans-serif";
    ctx.textAlign = "center"; ctx.textBaseline = "middle";
    document.querySelectorAll("#head-grid .head-cell").forEach((c) => {
      const share = g.sink_share[+c.dataset.layer][+c.dataset.head], pct = Math.round(share * 100) + "%";
      const [r, gg, b] = kv.weightColour(f(share)), x = +c.dataset.head * px, y = +c.dataset.layer * px;
      ctx.fillStyle = `rgb(${r},${gg},${b})`;
      ctx.fillRect(x, y, px, px);
      ctx.fillStyle = r * 0.3 + gg * 0.59 + b * 0.11 < 140 ? "#fff" : "#111";
      ctx.fillText(pct, x + px / 2, y + px / 2);
      c.dataset.sink = share.toFixed(4);
      c.title = kv.t("js.inspect.grid_sink_cell", { layer: c.dataset.layer, head: c.dataset.head, pct });
      c.setAttribute("aria-label", c.title);
    });
    paintSprite(sprite);
  }

  function toggleSinks() {
    const on = document.getElementById("grid-sinks").checked, g = S.grid;
    const legend = document.getElementById("grid-sinks-legend");
    legend.hidden = !on;
    document.getElementById("grid-legend").hidden = on;
    if (on && g && g.sink_share) {
      legend.textContent = kv.t("js.inspect.grid_sinks_legend",
        { token: g.first_token, uniform: Math.round(g.sink_uniform * 100) + "%" });
    }
    if (!on && g) {
      document.getElementById("head-grid").classList.remove("sinks");
      document.querySelectorAll("#head-grid .head-cell").forEach((c) => {
        delete c.dataset.sink;
        c.title = kv.t("js.inspect.grid_cell", { layer: +c.dataset.layer, head: +c.dataset.head }) +
          (S.KV < S.H ? " · kv " + kvGroup(+c.dataset.head) : "");
        c.setAttribute("aria-label", c.title);
      });
    }
    paintGrid();
  }

  function markGrid() {
    markOne(document.querySelectorAll("#head-grid .head-cell"),
      (c) => +c.dataset.layer === S.layer && +c.dataset.head === S.head, "aria-pressed");
  }

  /* The server's matrix as it came: float32 cells, the lower triangle only where masked ("lower"): row i holds
     past + i + 1 visible keys, starting at start(i). Read in place by the canvas (a 512-token head is 131 000
     cells: rows of JS arrays with nulls for the future cost the first paint a few hundred ms of building and
     collection); the rows Plotly wants are made once it is there (rows()). */
  function packed(m) {
    const vals = m.encoding === "sqrt-u8" ? fromSqrtU8(kv.b64ToBytes(m.data)) : kv.b64ToF32(m.data);
    const lower = m.packing === "lower";
    const start = (i) => (lower ? i * (m.past + 1) + (i * (i - 1)) / 2 : i * m.cols);
    const visible = (i) => (lower ? Math.min(m.cols, m.past + i + 1) : m.cols);
    return { m, vals, start, visible, z: null };
  }
  /* Weights sent for drawing as round(255·√w) (app/viz/attention.py sqrt_u8): back to (b / 255)², each cell's √
     within half a byte's step of the exact weight's, so it takes the colour the exact weight takes on the √ scale
     (the default) or one step beside it. */
  function fromSqrtU8(bytes) {
    const out = new Float32Array(bytes.length);
    for (let i = 0; i < bytes.length; i++) out[i] = kv.fromSqrtU8(bytes[i]);
    return out;
  }
  /* Rows for Plotly and the row chart; null marks cells the causal mask hides. */
  function rows(p) {
    if (p.z) return p.z;
    const { m, vals } = p, z = [];
    for (let i = 0; i < m.rows; i++) {
      const row = new Array(m.cols).fill(null), s = p.start(i), n = p.visible(i);
      for (let j = 0; j < n; j++) row[j] = vals[s + j];
      z.push(row);
    }
    return (p.z = z);
  }

  const title = (kind) => kv.t("js.kind." + kind);

  async function drawHead() {
    if (!document.getElementById("heatmap")) {  // a long prompt: the zoom canvas (static/zoom.js) shows the head
      document.body.dispatchEvent(new CustomEvent("kv-zoom-head", { detail: { layer: S.layer, head: S.head } }));
      document.getElementById("head-label").textContent =
        kv.t("js.inspect.head_label", { layer: S.layer, head: S.head, rows: S.T, cols: S.T });
      heatmapDrawn();
      return;
    }
    const want = `${S.layer}/${S.head}/${S.kind}`, mine = (S.drawing = {});
    const stale = () => want !== `${S.layer}/${S.head}/${S.kind}` || S.drawing !== mine; // a newer selection came
    const url = `/api/traces/${S.key}/attention/${S.layer}/${S.head}?kind=${S.kind}`;
    const box = document.getElementById("heatmap");
    // The first paint draws weights from one byte a cell (a quarter of float32's bytes: what the page receives
    // before its first heatmap); the exact float32 cells, which hover, the row chart and sums read, come with Plotly.
    const first = !window.Plotly && S.kind === "weights";
    const climbed = first && S.climb && S.climb.heads[`${S.layer}/${S.head}`];  // drawn during the capture
    let m = climbed || await kv.getJSON(first ? url + "&encoding=sqrt-u8" : url);
    if (stale()) return;
    let p = packed(m);
    if (!window.Plotly) {
      // First paint without Plotly: the same cells on a canvas now, the interactive chart once Plotly has loaded.
      paintCanvas(p);
      await kv.plotlyWhenUsed();
      if (stale()) return;
      if (m.encoding !== "f32") {
        m = await kv.getJSON(url);
        if (stale()) return;
        p = packed(m);
      }
      box.textContent = "";
    }
    S.matrix = { p, kind: m.kind, get z() { return rows(p); } };
    if (box._fullLayout && box._fullLayout._size && S.cols === m.cols) {
      // Another head of the same prompt: its cells on a canvas laid over the chart's plot area at once (same
      // axes), while Plotly redraws its interactive chart underneath (a few hundred ms at T = 512).
      overlayCanvas(box, p);
      await new Promise((go) => requestAnimationFrame(() => requestAnimationFrame(go)));  // shown before Plotly's work
      if (stale()) return;
    }
    const z = rows(p);
    const idx = [...Array(m.cols).keys()];
    const { small, margin } = heatLayout(m.cols);
    const ticks = small ? { tickvals: idx, ticktext: idx.map((i) => S.labels[i]) } : {};
    const weights = m.kind === "weights";
    const trace = {
      type: "heatmap", z, x: idx, y: idx.slice(0, m.rows),
      colorscale: weights ? kv.weightScale(S.scale) : "RdBu", reversescale: !weights,
      zmin: m.kind === "weights" ? 0 : undefined, zmax: m.kind === "weights" ? 1 : undefined,
      zmid: m.kind === "weights" ? undefined : 0,
      hoverongaps: false,
      colorbar: { title: { text: title(m.kind), side: "right" } },
      hovertemplate: kv.t("js.inspect.hover_cell", { q: "%{y}", k: "%{x}" }) + "<br>" + title(m.kind) +
        " = %{z:.6f}<extra></extra>",
    };
    if (m.cols <= 256) { // position and token on hover (skipped for long prompts: the payload grows as T²)
      const tok = S.labels.map((t, i) => kv.t("js.inspect.pos_token", { pos: i, token: t }));
      trace.customdata = z.map((row, i) => row.map((_, j) => [tok[i], tok[j]]));
      trace.hovertemplate = kv.t("js.inspect.hover_cell", { q: "%{customdata[0]}", k: "%{customdata[1]}" }) +
        "<br>" + title(m.kind) + " = %{z:.6f}<extra></extra>";
    }
    const axis = { zeroline: false, showgrid: false };
    const layout = {
      margin, font: kv.plotFont,
      plot_bgcolor: kv.MASK_COLOUR, // cells left empty (null) are the masked future
      xaxis: Object.assign({ title: { text: kv.t("js.inspect.axis_key") }, tickangle: small ? -60 : 0 }, axis, ticks),
      yaxis: Object.assign({ title: { text: kv.t("js.inspect.axis_query") }, autorange: "reversed" }, axis, ticks),
      shapes: marks(m.cols, null),
    };
    S.cols = m.cols;
    await Plotly.react("heatmap", [trace], layout, kv.PLOT_CONFIG);
    const el = document.getElementById("heatmap");
    el.querySelectorAll(".heat-overlay").forEach((c) => c.remove());
    el.removeAllListeners && el.removeAllListeners("plotly_click");
    el.removeAllListeners && el.removeAllListeners("plotly_hover");
    el.removeAllListeners && el.removeAllListeners("plotly_unhover");
    el.on("plotly_click", (ev) => { if (ev.points && ev.points.length) select({ q: ev.points[0].y }); });
    el.on("plotly_hover", (ev) => { if (ev.points && ev.points.length) markHeat(ev.points[0].x); });
    el.on("plotly_unhover", () => markHeat(null));
    document.getElementById("head-label").textContent =
      kv.t("js.inspect.head_label", { layer: S.layer, head: S.head, rows: m.rows, cols: m.cols });
    heatmapDrawn();
    document.body.dataset.heatmapPlotly = String((+document.body.dataset.heatmapPlotly || 0) + 1);
    drawRow();
  }

  /* The heatmap's frame, the same for the first paint and for Plotly: token labels on the axes while they fit
     (a phone: fewer), wider margins for them. */
  function heatLayout(cols) {
    const small = cols <= (kv.narrow() ? 16 : 32);
    return { small, margin: { l: small ? 90 : 60, r: 10, t: 10, b: small ? 90 : 55 } };
  }

  /* The heatmap before Plotly has loaded: its cells on a canvas, cell colours as Plotly will draw them, in the
     frame Plotly will draw (heatframe.js: axes, token labels, titles, colour bar), so the first paint is whole. */
  function paintCanvas(p) {
    const m = p.m, box = document.getElementById("heatmap"), { small, margin } = heatLayout(m.cols);
    const name = kv.t("js.inspect.head_label", { layer: S.layer, head: S.head, rows: m.rows, cols: m.cols });
    const frame = kv.heatFrame({
      canvas: heatCanvas(p, "heat-canvas"), cols: m.cols, rows: m.rows, q: S.q, margin, narrow: kv.narrow(),
      boxWidth: box.clientWidth, boxHeight: box.clientHeight, labels: small ? S.labels : null,
      xTitle: kv.t("js.inspect.axis_key"), yTitle: kv.t("js.inspect.axis_query"), bar: colourBar(p),
    });
    frame.setAttribute("role", "img");
    frame.setAttribute("aria-label", name);
    box.replaceChildren(frame);
    document.getElementById("head-label").textContent = name;
    heatmapDrawn();
  }

  /* The colour bar of the first paint: weights 0…1 on the chosen scale, scores on the canvas's blue–white–red. */
  function colourBar(p) {
    const kind = p.m.kind;
    if (kind === "weights") return { title: title(kind), stops: kv.weightScale(S.scale), lo: 0, hi: 1 };
    const span = scoreSpan(p.vals) || 1, stops = [];
    for (let i = 0; i <= 10; i++) stops.push([i / 10, `rgb(${scoreColour(i / 5 - 1).join(",")})`]);
    return { title: title(kind), stops, lo: -span, hi: span };
  }
  /* Scores on a blue (−span) – white (0) – red (+span) scale: u = score / span in [−1, 1]. */
  const scoreColour = (u) => (u >= 0 ? [255, 255 - 200 * u, 255 - 200 * u] : [255 + 200 * u, 255 + 200 * u, 255]);
  function scoreSpan(vals) {  // every value sent is a visible cell (the masked future is not sent)
    let span = 0;
    for (let i = 0; i < vals.length; i++) if (isFinite(vals[i])) span = Math.max(span, Math.abs(vals[i]));
    return span;
  }

  /* The same cells over the Plotly chart's plot area (its axes stay), removed once Plotly has redrawn. */
  function overlayCanvas(box, p) {
    const m = p.m, { l, t, w, h } = box._fullLayout._size, c = heatCanvas(p, "heat-overlay");
    Object.assign(c.style, { left: l + "px", top: t + "px", width: w + "px", height: h + "px" });
    c.setAttribute("aria-hidden", "true");
    box.querySelectorAll(".heat-overlay").forEach((old) => old.remove());
    box.appendChild(c);
    document.getElementById("head-label").textContent =
      kv.t("js.inspect.head_label", { layer: S.layer, head: S.head, rows: m.rows, cols: m.cols });
    heatmapDrawn();
  }

  /* A weight's colour through a table of LEVELS steps of f(w) (f: the chosen scale), not a call and an array per
     cell: weightColour is linear between stops, at most ~400 colour units per unit of f, so a step of 1/4096 moves a
     channel by 0.1 — the same 8-bit colour Plotly draws, give or take one unit where it rounds. */
  const LEVELS = 4096;
  function weightLut() {
    const lut = new Uint8ClampedArray(3 * (LEVELS + 1));
    for (let i = 0; i <= LEVELS; i++) {
      const [r, g, b] = kv.weightColour(i / LEVELS);
      lut[3 * i] = r; lut[3 * i + 1] = g; lut[3 * i + 2] = b;
    }
    return lut;
  }

  /* One pixel per cell: weights on the chosen scale, scores on a blue–white–red scale around 0, masked cells in
     the mask colour (the colours Plotly draws), read straight from the packed cells. */
  function heatCanvas(p, cls) {
    const m = p.m, vals = p.vals, c = kv.el("canvas", { width: m.cols, height: m.rows, class: cls });
    const ctx = c.getContext("2d"), img = ctx.createImageData(m.cols, m.rows), d = img.data;
    const weights = m.kind === "weights", f = kv.SCALES[S.scale].f, mask = kv.MASK_RGB;
    const span = weights ? 0 : scoreSpan(vals), lut = weights ? weightLut() : null;
    for (let i = 0; i < m.rows; i++) {
      const s = p.start(i), n = p.visible(i);
      for (let j = 0; j < m.cols; j++) {
        const o = 4 * (i * m.cols + j), v = j < n ? vals[s + j] : NaN;
        d[o + 3] = 255;
        if (!isFinite(v)) { d[o] = mask[0]; d[o + 1] = mask[1]; d[o + 2] = mask[2]; continue; }
        if (weights) {
          const at = 3 * Math.round(Math.min(1, Math.max(0, f(v))) * LEVELS);
          d[o] = lut[at]; d[o + 1] = lut[at + 1]; d[o + 2] = lut[at + 2];
        } else {
          const rgb = scoreColour(span ? v / span : 0);
          d[o] = rgb[0]; d[o + 1] = rgb[1]; d[o + 2] = rgb[2];
        }
      }
    }
    ctx.putImageData(img, 0, 0);
    if (S.cached) { // a served request's cached key columns, veiled as the chart's shape veils them (marks)
      ctx.fillStyle = CACHED_VEIL;
      ctx.fillRect(0, 0, Math.min(S.cached, m.cols), m.rows);
    }
    return c;
  }

  /* Counted for tests and benchmarks; the grid, the explainer panels below (sinks, lens, ablation) and the why
     panel are asked for on the first one, so their requests never hold up the heatmap's. Told once the frame that
     shows it has been painted: dispatched here, their listeners (a request each, htmx's processing of the slots)
     ran in this task, before that frame, and the heatmap reached the screen tens of ms later on 2 busy cores. */
  function heatmapDrawn() {
    document.body.dataset.heatmapDrawn = String((+document.body.dataset.heatmapDrawn || 0) + 1);
    requestAnimationFrame(() => setTimeout(() => document.body.dispatchEvent(new CustomEvent("kv-heatmap")), 0));
  }

  const CACHED_VEIL = "rgba(107,114,128,0.22)";  // over the key columns a served request read from cached blocks
  /* The selected query's row framed; the hovered key's column too (both as layout shapes: no redraw of cells). */
  function marks(cols, key) {
    const out = [{ type: "rect", xref: "x", yref: "y", x0: -0.5, x1: cols - 0.5, y0: S.q - 0.5, y1: S.q + 0.5,
      line: { color: "#d08a00", width: 3 }, fillcolor: "rgba(0,0,0,0)" }];
    // A served request's keys that came from cached blocks (another request computed them): their columns shaded
    // under a hatch-free grey veil, with the banner above naming the blocks.
    if (S.cached) out.unshift({ type: "rect", xref: "x", yref: "paper", x0: -0.5, x1: S.cached - 0.5, y0: 0, y1: 1,
      line: { color: "#6b7280", width: 1, dash: "dot" }, fillcolor: CACHED_VEIL, layer: "above",
      name: "cached-keys" });
    // The tokens summed: their rows (query tokens) or columns (key tokens), dashed.
    const rows = S.matrix ? S.matrix.p.m.rows : cols;
    for (const t of S.multi) {
      out.push(S.over === "q"
        ? { type: "rect", xref: "x", yref: "y", x0: -0.5, x1: cols - 0.5, y0: t - 0.5, y1: t + 0.5,
          line: { color: "#b45309", width: 2, dash: "dash" }, fillcolor: "rgba(0,0,0,0)" }
        : { type: "rect", xref: "x", yref: "y", x0: t - 0.5, x1: t + 0.5, y0: -0.5, y1: rows - 0.5,
          line: { color: "#b45309", width: 2, dash: "dash" }, fillcolor: "rgba(0,0,0,0)" });
    }
    if (key !== null && key !== undefined) out.push({ type: "rect", xref: "x", yref: "y", x0: key - 0.5, x1: key + 0.5,
      y0: -0.5, y1: S.matrix.z.length - 0.5, line: { color: "#6a3fb5", width: 2, dash: "dot" }, fillcolor: "rgba(0,0,0,0)" });
    return out;
  }
  function markHeat(key) {
    if (!S.matrix || !window.Plotly || !document.getElementById("heatmap").layout || S.hoverKey === key) return;
    S.hoverKey = key;
    Plotly.relayout("heatmap", { shapes: marks(S.cols, key) });
  }

  function drawRow() {
    if (!S.matrix || !window.Plotly) return; // drawHead draws the row once Plotly has loaded
    S.hoverKey = undefined;
    markHeat(null);
    if (showMulti()) { drawSum(); return; }
    const row = S.matrix.z[S.q] || [];
    const n = S.q + 1; // keys the query may read
    const x = [...Array(n).keys()];
    const y = row.slice(0, n);
    delete document.getElementById("row-chart").dataset.sum;
    const small = n <= (kv.narrow() ? 24 : 48);
    Plotly.react("row-chart", [{
      type: "bar", x, y, marker: { color: "#3a72c4" },
      hovertemplate: kv.t("js.inspect.hover_key", { k: "%{x}" }) + "<br>" + title(S.matrix.kind) +
        " = %{y:.6f}<extra></extra>",
    }], {
      margin: { l: 70, r: 10, t: 10, b: small ? 90 : 50 }, font: kv.plotFont,
      xaxis: Object.assign({ title: { text: kv.t("js.inspect.axis_key_short") } },
        small ? { tickvals: x, ticktext: x.map((i) => S.labels[i]), tickangle: -60 } : {}),
      yaxis: { title: { text: title(S.matrix.kind) } },
    }, kv.PLOT_CONFIG);
    document.getElementById("row-label").textContent =
      kv.t("js.inspect.row_label", { q: S.q, token: S.labels[S.q] || "", layer: S.layer, head: S.head });
  }

  /* --- Several tokens summed (bertviz #125) -------------------------------------------------------------------
     S.multi: the positions summed (two or more, sorted; [] when one token is selected), S.over: "q" (their rows:
     what they read, together) or "k" (their columns: how much each query reads them), S.agg: "sum" or "mean".
     The numbers are the head's softmax weights the page already has (the float32 matrix of /attention), added in
     double precision here; nothing new is asked of the server. */
  function multiFromUrl(T) {
    const u = new URL(window.location.href).searchParams;
    const multi = [...new Set((u.get("sum") || "").split(",").filter((x) => /^\d+$/.test(x)).map(Number))]
      .filter((p) => p < T).sort((a, b) => a - b);
    return { multi: multi.length >= 2 ? multi : [], over: u.get("over") === "k" ? "k" : "q",
      agg: u.get("agg") === "mean" ? "mean" : "sum" };
  }

  function initMulti() {
    const box = document.getElementById("multi-controls");
    if (!box) return;  // a long prompt: the zoom map, no row chart
    const line = document.getElementById("multi-line");
    if (!line.dataset.hint) line.dataset.hint = line.textContent;
    box.querySelectorAll("input[name=multi-over]").forEach((el) => {
      el.checked = el.value === S.over;
      el.addEventListener("change", () => { S.over = el.value; syncUrl(); drawRow(); });
    });
    box.querySelectorAll("input[name=multi-agg]").forEach((el) => {
      el.checked = el.value === S.agg;
      el.addEventListener("change", () => { S.agg = el.value; syncUrl(); drawRow(); });
    });
    document.getElementById("multi-clear").addEventListener("click", () => {
      document.getElementById("multi-pick").checked = false;
      pick(S.q, false);
    });
    const strip = document.getElementById("token-strip");
    if (strip) strip.setAttribute("aria-multiselectable", "true");
  }

  /* A token clicked: alone (one token selected, as before) or added to / taken out of the tokens summed (the
     selected token is the first one when a sum starts). */
  function pick(pos, add) {
    if (!add || !document.getElementById("multi-controls")) {
      const had = S.multi.length;
      S.multi = [];
      if (pos === S.q && had) { syncUrl(); markToken(); drawRow(); return; }
      select({ q: pos });
      return;
    }
    const set = S.multi.length ? S.multi.slice() : [S.q], at = set.indexOf(pos);
    if (at >= 0) set.splice(at, 1); else set.push(pos);
    set.sort((a, b) => a - b);
    S.multi = set.length >= 2 ? set : [];
    syncUrl();
    markToken();
    drawRow();
  }

  /* The line saying what is summed, the controls' state; true when the chart shows a sum. */
  function showMulti() {
    const line = document.getElementById("multi-line");
    if (!line) return false;
    const on = S.multi.length >= 2, n = S.multi.length;
    document.getElementById("multi-clear").hidden = !on;
    document.getElementById("multi-controls").classList.toggle("active", on);
    line.classList.toggle("on", on);  // said in presenter mode too, which hides the page's other explanations
    if (!on) { line.textContent = line.dataset.hint || ""; return false; }
    if (S.matrix.kind !== "weights") {
      line.textContent = kv.t("js.inspect.multi_weights_only", { n });
      return false;
    }
    const MAX = 12, names = S.multi.slice(0, MAX).map((p) => kv.t("js.inspect.pos_token", { pos: p, token: S.labels[p] || "" }));
    let list = names.join(kv.t("js.inspect.multi_sep"));
    if (n > MAX) list += " " + kv.t("js.inspect.multi_more", { n: n - MAX });
    line.textContent = kv.t(`js.inspect.multi_${S.over}_${S.agg}`, { n, list });
    return true;
  }

  /* The sum (or mean) of the selected rows (query tokens: one bar per key) or columns (key tokens: one bar per
     query); a cell in a query's future is a weight of exactly 0 (the causal mask). */
  function sumOf(z, multi, over, agg) {
    const rows = z.length, n = multi.length, at = (i, j) => z[i][j] || 0;
    const x = over === "q" ? [...Array(Math.max(...multi) + 1).keys()]
      : [...Array(rows - Math.min(...multi)).keys()].map((i) => i + Math.min(...multi));
    const y = x.map((t) => multi.reduce((s, u) => s + (over === "q" ? at(u, t) : at(t, u)), 0) / (agg === "mean" ? n : 1));
    return { x, y };
  }

  function drawSum() {
    const n = S.multi.length, { x, y } = sumOf(S.matrix.z, S.multi, S.over, S.agg);
    const small = x.length <= (kv.narrow() ? 24 : 48), q = S.over === "q";
    const tok = x.map((i) => kv.t("js.inspect.pos_token", { pos: i, token: S.labels[i] || "" }));
    Plotly.react("row-chart", [{
      type: "bar", x, y, marker: { color: "#b45309" }, customdata: tok,
      hovertemplate: kv.t(q ? "js.inspect.hover_key" : "js.inspect.hover_query", { k: "%{customdata}", q: "%{customdata}" }) +
        "<br>" + kv.t(`js.inspect.y_${S.agg}_${S.over}`, { n }) + " = %{y:.6f}<extra></extra>",
    }], {
      margin: { l: 70, r: 10, t: 10, b: small ? 90 : 50 }, font: kv.plotFont,
      xaxis: Object.assign({ title: { text: kv.t(q ? "js.inspect.axis_key_short" : "js.inspect.axis_query_short") } },
        small ? { tickvals: x, ticktext: x.map((i) => S.labels[i]), tickangle: -60 } : {}),
      yaxis: { title: { text: kv.t(`js.inspect.y_${S.agg}_${S.over}`, { n }) }, rangemode: "tozero" },
    }, kv.PLOT_CONFIG);
    const el = document.getElementById("row-chart");
    el.dataset.sum = S.multi.join(",");  // what the bars add up (tests read it with the bars)
    document.getElementById("row-label").textContent = kv.t(`js.inspect.multi_label_${S.over}`,
      { agg: kv.t(S.agg === "mean" ? "js.inspect.agg_mean" : "js.inspect.agg_sum"), n, layer: S.layer, head: S.head });
  }

  // Not page.view("result", …): that also redraws after the swaps inside the result (query panels, lens), which
  // must not fetch the heatmap again. The result is drawn when the page opens and when a new one is swapped in.
  kv.page("inspect", () => {
    init();
    document.addEventListener("htmx:afterSwap", (e) => { if (e.target.id === "result") init(); });
  });
})();
