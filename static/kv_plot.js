/* Plotly for every chart: loaded after the first paint and only when a page draws, one config (PNG/SVG buttons
   from the catalog), phone layouts (colour bar above, text 14 px or more, titles that fit), a keyboard bar. */
(function () {
  "use strict";
  const kv = (window.kv = window.kv || {});
  kv.plotFont = { size: 15, family: "system-ui, sans-serif" };
  /* One Plotly config for every chart. The mode bar shows only our two buttons (PNG and SVG download,
     titles from the catalog; Plotly's own buttons have English-only tooltips); drag still zooms and a
     double click resets. The buttons are added once Plotly has loaded (configurePlotly). */
  kv.PLOT_CONFIG = { responsive: true, displaylogo: false, displayModeBar: false };
  /* Plotly (4.8 MB, ~1 s to parse) is loaded only by pages that draw, only when they first need it, and
     never before the first paint: kv.plotly() adds its script tag once and resolves when it has run. Its
     URL (versioned, so the browser caches it) is in <meta name="kv-plotly">. */
  let plotlyLoading = null;
  /* Every chart's toolbar (all pages, whatever config a page passes): the camera button saves a PNG, one
     more button saves an SVG, both through Plotly's own Plotly.downloadImage. Set once, when Plotly is there. */
  let plotlyConfigured = false;
  function configurePlotly(P) {
    if (plotlyConfigured || !P || !P.setPlotConfig) return P;
    plotlyConfigured = true;
    const save = (format, title, icon) => ({
      name: "kvscope-" + format, title: title, icon: icon,
      click: function (gd) { P.downloadImage(gd, { format: format, filename: "kvscope", scale: format === "png" ? 2 : 1 }); },
    });
    kv.PLOT_CONFIG.displayModeBar = "hover";
    kv.PLOT_CONFIG.modeBarButtons = [[save("png", kv.t("js.export.png"), P.Icons.camera),
                                      save("svg", kv.t("js.export.svg"), P.Icons.disk || P.Icons.camera)]];
    // Keyboard: after every draw, the mode bar's buttons leave the tab order and the chart gets our own bar.
    ["newPlot", "react", "relayout", "restyle", "update"].forEach((name) => {
      const orig = P[name];
      if (typeof orig !== "function") return;
      P[name] = function () {
        if ((name === "newPlot" || name === "react") && kv.narrow()) {
          if (Array.isArray(arguments[1])) arguments[1] = arguments[1].map(barUnder);
          if (arguments[2] && typeof arguments[2] === "object") arguments[2] = phoneLayout(arguments[0], arguments[2], arguments[1]);
        }
        const out = orig.apply(this, arguments);
        Promise.resolve(out).then(chartKeyboard, () => {});
        return out;
      };
    });
    return P;
  }
  /* On a phone a vertical colour bar takes a third of the chart's width: it goes above the cells instead. */
  kv.narrow = () => window.matchMedia("(max-width: 600px)").matches;
  function barUnder(trace) {
    if (!trace || trace.showscale === false || !(trace.type === "heatmap" || trace.colorbar)) return trace;
    const bar = Object.assign({}, trace.colorbar, { orientation: "h", thickness: 12, len: 1, x: 0.5, xanchor: "center" });
    if (bar.title) bar.title = Object.assign({}, bar.title, { side: "top" });
    return Object.assign({}, trace, { colorbar: bar });
  }
  /* On a phone every chart's text is 14 px or more and its titles stay inside it: smaller sizes are raised, a
     title wider than its room is broken into lines (the axis then makes room for them), and a log axis labels only
     powers of ten (Plotly draws the 2s and 5s between them at ¾ size). */
  const MIN_PX = 14;
  const floorFont = (o) => (o && o.font && o.font.size < MIN_PX ? Object.assign({}, o, { font: Object.assign({}, o.font, { size: MIN_PX }) }) : o);
  const MODEBAR_PX = 40;  // the PNG / SVG buttons' strip at the chart's top right: nothing is drawn under it
  function phoneLayout(gd, layout, traces) {
    const el = typeof gd === "string" ? document.getElementById(gd) : gd;
    const L = Object.assign({}, layout), W = (el && el.clientWidth) || window.innerWidth;
    const size = Math.max(MIN_PX, (L.font && L.font.size) || 12), family = (L.font && L.font.family) || kv.plotFont.family;
    L.font = Object.assign({}, L.font, { size });
    const m = Object.assign({ l: 80, r: 80, t: 100, b: 80 }, L.margin), H = L.height || (el && el.clientHeight) || 450;
    if (L.legend) L.legend = floorFont(L.legend);
    // The top margin holds, from the top: the mode bar, the title's lines, a colour bar moved above the cells (its
    // title on top) or a legend above the plot. Each gets its own band, so none is drawn over another.
    const shown = Array.isArray(traces) ? traces.filter((t) => t && t.visible !== false) : [];
    const hasBar = shown.some((t) => t.showscale !== false && (t.type === "heatmap" || t.colorbar));
    const legendAbove = L.legend && L.legend.orientation === "h" &&  // above the plot, under the buttons (below, it meets the x title)
      shown.filter((t) => t.showlegend !== false && t.name).length > 1;
    let top = MODEBAR_PX;
    if (L.title) {
      L.title = fitTitle(L.title, size * 1.4, family, W - 20);
      const lines = ((L.title.text || "").match(/<br>/gi) || []).length + 1;
      // its first line just under the mode bar's band: Plotly anchors a title of several lines at its first line
      // and draws the others above it, so the anchor goes down by those lines
      L.title = Object.assign({}, L.title, { yref: "container", yanchor: "top", pad: { t: 0, b: 0 },
        y: 1 - (MODEBAR_PX + 8 + (lines - 1) * size * 1.4) / H });
      top += lines * size * 1.4 + 16;
    }
    if (hasBar) top += 70;  // 12 px bar, its ticks, its title above it
    if (legendAbove) {
      const names = shown.filter((t) => t.showlegend !== false && t.name).map((t) => textWidth(String(t.name), size, family) + 60);  // its symbol and gap, generously
      let rows = 1, run = 0;
      for (const w of names) { if (run && run + w > W - 20) { rows++; run = 0; } run += w; }
      L.legend = Object.assign({}, L.legend, { y: 1.02, yanchor: "bottom" });
      top += rows * size * 1.9 + 12;
    }
    L.margin = Object.assign({}, L.margin, { t: Math.max((L.margin && L.margin.t) || 0, Math.ceil(top)) });
    m.t = L.margin.t;
    if (L.annotations) L.annotations = L.annotations.map(floorFont);
    for (const k of Object.keys(L)) {
      if (!/^[xy]axis\d*$/.test(k) || !L[k]) continue;
      const ax = Object.assign({}, L[k]), dom = ax.domain || [0, 1];
      const room = (k[0] === "x" ? W - m.l - m.r : H - m.t - m.b) * (dom[1] - dom[0]) - 8;
      if (ax.tickfont && ax.tickfont.size < MIN_PX) ax.tickfont = Object.assign({}, ax.tickfont, { size: MIN_PX });
      if (ax.title) {  // broken into lines that fit, and the margin made room for it beside its tick labels
        ax.title = fitTitle(ax.title, size * 1.2, family, room);
        ax.automargin = true;
      }
      if (ax.type === "log" && ax.dtick === undefined) ax.dtick = 1;
      L[k] = ax;
    }
    return L;
  }
  /* A chart or axis title (a string or {text, font}) broken into lines of at most `room` pixels, at spaces or
     between Chinese characters; font sizes under 14 px raised. Plotly's default title sizes: `size`. */
  function fitTitle(title, size, family, room) {
    const t = floorFont(typeof title === "string" ? { text: title } : Object.assign({}, title));
    const px = (t.font && t.font.size) || size, text = t.text;
    if (!text || /<br>/i.test(text) || textWidth(text, px, family) <= room) return t;
    const CJK = "\u2e80-\u9fff\uff00-\uffef";
    const words = text.match(new RegExp(`\\s*(?:[${CJK}]|[^\\s${CJK}]+)`, "g")) || [text];
    const lines = [];
    let line = "";
    for (const w of words) {
      if (line && textWidth(line + w, px, family) > room) { lines.push(line); line = w.trimStart(); } else line += w;
    }
    lines.push(line);
    return Object.assign(t, { text: lines.join("<br>") });
  }
  /* The width in pixels of one line of text in this font (a canvas measures it; nothing is laid out). */
  let ruler = null;
  const textWidth = (kv.textWidth = function (text, px, family) {
    ruler = ruler || document.createElement("canvas").getContext("2d");
    ruler.font = `${px}px ${family || kv.plotFont.family}`;
    return ruler.measureText(text).width;
  });
  /* A chart's download bar for the keyboard: one tab stop (role=toolbar, ←/→ between PNG and SVG), out of
     sight until focused (a11y.css). Plotly's mode-bar buttons get tabindex=-1 each time Plotly draws. */
  function chartKeyboard(gd) {
    if (!gd || !gd.classList || !gd.classList.contains("js-plotly-plot")) return gd;
    gd.querySelectorAll(".modebar-btn").forEach((b) => b.setAttribute("tabindex", "-1"));
    if (!gd.dataset.kvKeys) {
      gd.dataset.kvKeys = "1";
      if (gd.on) gd.on("plotly_afterplot", () => chartKeyboard(gd));
    }
    // A chart with buttons in it is a figure, not an image (an image's children are presentational).
    if (gd.getAttribute("role") === "img") gd.setAttribute("role", "figure");
    if (gd.querySelector(":scope > .chart-export")) return gd;
    const P = window.Plotly;
    const btn = (format, i) => {
      const b = kv.el("button", { type: "button", class: "secondary", tabindex: i ? -1 : 0,
        "aria-label": kv.t("js.a11y." + format + "_long") }, kv.t("js.a11y." + format));
      b.addEventListener("click", () => P.downloadImage(gd, { format, filename: "kvscope", scale: format === "png" ? 2 : 1 }));
      return b;
    };
    const bar = kv.el("div", { class: "chart-export", role: "toolbar", "aria-label": kv.t("js.a11y.chart") },
      btn("png", 0), btn("svg", 1));
    kv.rovingKeys(bar, "button", { orientation: "horizontal" });
    gd.prepend(bar);
    return gd;
  }
  kv.plotly = function () {
    if (window.Plotly) return Promise.resolve(configurePlotly(window.Plotly));
    if (!plotlyLoading) {
      plotlyLoading = new Promise((resolve, reject) => {
        const meta = document.querySelector("meta[name=kv-plotly]");
        const tag = document.createElement("script");
        tag.src = meta ? meta.content : "/vendor/plotly.min.js";
        tag.onload = () => resolve(configurePlotly(window.Plotly));
        tag.onerror = () => { plotlyLoading = null; reject(new Error("plotly")); };
        // After the first paint: two animation frames, so what the server sent is on screen first.
        requestAnimationFrame(() => requestAnimationFrame(() => document.head.appendChild(tag)));
      });
    }
    return plotlyLoading;
  };
  /* Plotly once the reader starts using the page (moves the pointer, scrolls, presses a key), or after a few
     quiet seconds: a page that has already painted its data (Inspect's canvas heatmap) stays responsive
     while it loads and parses. */
  let plotlyWanted = null;
  kv.plotlyWhenUsed = function (quietMs) {
    if (window.Plotly) return Promise.resolve(window.Plotly);
    if (!plotlyWanted) {
      plotlyWanted = new Promise((resolve) => {
        const events = ["pointermove", "pointerdown", "keydown", "wheel", "touchstart", "scroll"];
        let timer = null;
        const go = () => {
          clearTimeout(timer);
          events.forEach((e) => window.removeEventListener(e, go, true));
          resolve(kv.plotly());
        };
        events.forEach((e) => window.addEventListener(e, go, { capture: true, passive: true, once: true }));
        timer = setTimeout(go, quietMs || 8000);
      });
    }
    return plotlyWanted;
  };
})();
