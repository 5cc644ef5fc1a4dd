/* Small helpers shared by KVScope pages. */
(function () {
  "use strict";
  const kv = (window.kv = window.kv || {});
  let strings = null;
  /* The page's language ("en", "zh"): every request a page makes carries it, so answers match the page. */
  const langMeta = document.querySelector("meta[name=kv-lang]");
  kv.lang = langMeta ? langMeta.content : "en";

  /* A UI string from the server's translation catalog ("js." keys), with {name} placeholders filled. */
  kv.t = function (key, vars) {
    if (strings === null) {
      const el = document.getElementById("i18n-strings");
      strings = el ? JSON.parse(el.textContent) : {};
    }
    if (vars && +vars.n === 1 && strings[key + ".one"]) key += ".one";  // "1 token" beside "{n} tokens"
    const text = strings[key] || key;
    return vars ? text.replace(/\{(\w+)\}/g, (m, name) => (name in vars ? String(vars[name]) : m)) : text;
  };

  kv.b64ToBytes = function (b64) {
    const bin = atob(b64);
    const out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  };
  kv.b64ToF32 = function (b64) {
    const bytes = kv.b64ToBytes(b64);
    return new Float32Array(bytes.buffer, bytes.byteOffset, bytes.byteLength / 4);
  };
  /* The one way pages talk to the JSON API. On an error status the server's message (already in the page's
     language) is shown in #error and the promise rejects with an Error carrying .status; a network failure
     says so the same way. */
  kv.request = async function (method, url, body) {
    let r;
    try {
      r = await fetch(url, body === undefined ? { method, headers: { "X-KVScope-Lang": kv.lang } } : {
        method, headers: { "Content-Type": "application/json", "X-KVScope-Lang": kv.lang }, body: JSON.stringify(body),
      });
    } catch (e) {
      kv.showError(kv.t("js.error.unreachable"));
      throw Object.assign(new Error("unreachable"), { status: 0 });
    }
    let data = null;
    try { data = await r.json(); } catch (e) { data = null; }
    if (!r.ok) {
      const msg = (data && data.detail) || kv.t("js.error.request_failed", { status: r.status });
      kv.showError(msg);
      throw Object.assign(new Error(msg), { status: r.status });
    }
    return data;
  };
  kv.getJSON = (url) => kv.request("GET", url);
  kv.postJSON = (url, body) => kv.request("POST", url, body);
  /* A run followed live (the labs' lines: arena, training): POST body, then the server sends one JSON object per
     line as the run goes (its place in line, its progress, how it ended); onEvent(ev) gets each as it arrives.
     Resolves with the last one. An error status is shown in #error (as kv.request) and rejects. signal: an
     AbortController's; aborting closes the connection, and the server then stops the run. */
  kv.follow = async function (url, body, onEvent, signal) {
    let r;
    try {
      r = await fetch(url, { method: "POST", signal, body: JSON.stringify(body || {}),
        headers: { "Content-Type": "application/json", "X-KVScope-Lang": kv.lang } });
    } catch (e) {
      if (signal && signal.aborted) throw e;
      kv.showError(kv.t("js.error.unreachable"));
      throw Object.assign(new Error("unreachable"), { status: 0 });
    }
    if (!r.ok) {
      let data = null;
      try { data = await r.json(); } catch (e) { data = null; }
      const msg = (data && data.detail) || kv.t("js.error.request_failed", { status: r.status });
      kv.showError(msg);
      throw Object.assign(new Error(msg), { status: r.status });
    }
    const reader = r.body.getReader(), decoder = new TextDecoder();
    let buffered = "", last = null;
    for (;;) {
      const { value, done } = await reader.read();  // rejects when the connection breaks or is aborted
      if (done) break;
      buffered += decoder.decode(value, { stream: true });
      let nl;
      while ((nl = buffered.indexOf("\n")) >= 0) {
        const line = buffered.slice(0, nl).trim();
        buffered = buffered.slice(nl + 1);
        if (line) { last = JSON.parse(line); onEvent(last); }
      }
    }
    return last;
  };
  kv.clearError = function () { const a = document.getElementById("error"); if (a) a.textContent = ""; };
  /* A user's action that asks the server (a button, a changed field): the last message leaves #error, the
     indicator `busy` (an element's id; optional) shows while it runs, as htmx's hx-indicator does (the
     .htmx-request class), and the answer comes back, or null when it failed (kv.request has shown why). */
  kv.act = async function (method, url, body, busy) {
    kv.clearError();
    const box = busy ? document.getElementById(busy) : null;
    if (box) box.classList.add("htmx-request");
    try {
      return await kv.request(method, url, body);
    } catch (e) {
      return null;
    } finally {
      if (box) box.classList.remove("htmx-request");
    }
  };
  /* Tell the server the page let go of something (a decode session, a run it stopped): nothing to show if that
     fails, the server lets it go by itself in time. */
  kv.forget = (url) => fetch(url, { method: "DELETE", headers: { "X-KVScope-Lang": kv.lang } }).catch(() => null);
  kv.$ = (id) => document.getElementById(id);

  /* The one entry point of every page's script (README, "Front-end page pattern"): kv.page("capacity", start)
     runs start(page) once the document is parsed, and only on that page (<main data-page="capacity">, from the
     route's render(..., page=...)). page.view(id, draw) is how a script draws what the server rendered into
     #id: draw(element) runs now if it is there, and again after every htmx swap that replaces it or changes
     something in it. */
  kv.page = function (name, start) {
    const go = () => {
      const main = document.getElementById("main");
      if (!main || main.dataset.page !== name) return;
      start({
        name, main,
        view(id, draw) {
          const now = document.getElementById(id);
          if (now) draw(now);
          document.addEventListener("htmx:afterSettle", (e) => {
            const el = document.getElementById(id);
            if (el && e.target && (e.target === el || e.target.contains(el) || el.contains(e.target))) draw(el);
          });
        },
      });
    };
    if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", go);
    else go();
  };
  /* The page's state in its address, so a view can be linked and a reload keeps it: each given query parameter
     is set (null or undefined deletes it). push: a new history entry (a run); else the entry is replaced (a sort,
     a selection). */
  kv.setQuery = function (params, push) {
    const u = new URL(window.location.href);
    for (const [k, v] of Object.entries(params)) {
      if (v === null || v === undefined) u.searchParams.delete(k); else u.searchParams.set(k, String(v));
    }
    window.history[push ? "pushState" : "replaceState"](window.history.state, "", u.toString());
  };
  /* Bytes for people: 1,536 → "1.5 KiB" (the same units as the server's |bytes filter). precise: up to two
     decimals, trailing zeros dropped, up to TiB ("57.04 GiB", "2 MiB"): the capacity calculator, whose figures
     are read beside vLLM's log. */
  kv.bytes = function (n, precise) {
    const units = precise ? ["B", "KiB", "MiB", "GiB", "TiB"] : ["B", "KiB", "MiB", "GiB"];
    let i = 0, x = Math.abs(n);
    while (x >= 1024 && i < units.length - 1) { x /= 1024; i++; }
    if (!precise) return (n < 0 ? "-" : "") + (i === 0 ? x.toFixed(0) : x.toFixed(1)) + " " + units[i];
    const s = i === 0 ? x.toFixed(x % 1 ? 2 : 0) : (x >= 100 ? x.toFixed(1) : x.toFixed(2));
    return (n < 0 ? "−" : "") + s.replace(/\.0+$/, "") + " " + units[i];
  };
  /* A count with thousands separators: 467280 → "467,280" (the same in every language, as the server writes it). */
  kv.int = (n) => Math.round(n).toLocaleString("en");
  /* A duration given in seconds, in milliseconds: 0.0123 → "12.3 ms" (two decimals under 10 ms); none → "—". */
  kv.ms = (s) => (s === null || s === undefined ? "—" : (s * 1000).toFixed(s < 0.01 ? 2 : 1) + " ms");
  /* The page's error banner (#error): the message as text, never HTML, with a close button — as the server's
     own error fragment (partials/_error.html) that htmx swaps in there. */
  kv.showError = function (message) {
    const area = document.getElementById("error");
    if (!area) return;
    const close = kv.el("button", { type: "button", class: "close", "data-dismiss": true, "aria-label": kv.t("js.error.dismiss") }, "×");
    area.replaceChildren(kv.el("div", { class: "error-box" }, kv.el("b", null, kv.t("js.error.prefix")), " ", message, " ", close));
  };
  kv.fmt = function (x, d) {
    if (x === null || x === undefined) return "—";
    if (!isFinite(x)) return x > 0 ? "+∞" : "−∞";
    return Number(x).toFixed(d === undefined ? 4 : d);
  };
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
          if (arguments[2] && typeof arguments[2] === "object") arguments[2] = phoneLayout(arguments[0], arguments[2]);
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
  function phoneLayout(gd, layout) {
    const el = typeof gd === "string" ? document.getElementById(gd) : gd;
    const L = Object.assign({}, layout), W = (el && el.clientWidth) || window.innerWidth;
    const size = Math.max(MIN_PX, (L.font && L.font.size) || 12), family = (L.font && L.font.family) || kv.plotFont.family;
    L.font = Object.assign({}, L.font, { size });
    const m = Object.assign({ l: 80, r: 80, t: 100, b: 80 }, L.margin), H = L.height || (el && el.clientHeight) || 450;
    if (L.legend) L.legend = floorFont(L.legend);
    if (L.annotations) L.annotations = L.annotations.map(floorFont);
    if (L.title) {
      L.title = fitTitle(L.title, size * 1.4, family, W - 20);
      // The lines stand on the plot's top edge (where Plotly places a title of several lines right), and the top
      // margin grows to hold them.
      if (L.title.text && L.title.text.includes("<br>")) {
        L.title = Object.assign({ y: 1, yref: "paper", yanchor: "bottom", pad: { b: 8 }, automargin: true }, L.title);
      }
    }
    for (const k of Object.keys(L)) {
      if (!/^[xy]axis\d*$/.test(k) || !L[k]) continue;
      const ax = Object.assign({}, L[k]), dom = ax.domain || [0, 1];
      const room = (k[0] === "x" ? W - m.l - m.r : H - m.t - m.b) * (dom[1] - dom[0]) - 8;
      if (ax.tickfont && ax.tickfont.size < MIN_PX) ax.tickfont = Object.assign({}, ax.tickfont, { size: MIN_PX });
      if (ax.title) {
        ax.title = fitTitle(ax.title, size * 1.2, family, room);
        if (ax.title.text && ax.title.text.includes("<br>")) ax.automargin = true;
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
  /* Roving tabindex: a group that is one tab stop, its items reached with the arrow keys (Home/End too).
     onMove(item) runs when an arrow moves the focus (a listbox selects there; a toolbar does nothing).
     cols(): items per row for ↑/↓ in a two-dimensional group. */
  kv.rovingKeys = function (group, selector, opts) {
    const o = opts || {};
    group.addEventListener("keydown", (e) => {
      const items = [...group.querySelectorAll(selector)];
      const i = items.indexOf(e.target);
      if (i < 0) return;
      const cols = o.cols ? o.cols() : items.length;
      const horiz = o.orientation !== "vertical", vert = o.orientation !== "horizontal";
      let j = null;
      if (e.key === "ArrowRight" && horiz) j = i + 1;
      else if (e.key === "ArrowLeft" && horiz) j = i - 1;
      else if (e.key === "ArrowDown" && vert) j = o.cols ? i + cols : i + 1;
      else if (e.key === "ArrowUp" && vert) j = o.cols ? i - cols : i - 1;
      else if (e.key === "Home") j = 0;
      else if (e.key === "End") j = items.length - 1;
      if (j === null) return;
      e.preventDefault();
      e.stopPropagation();  // the arrows belong to this group here, not to a page-wide shortcut (a lesson's Next/Back)
      j = Math.max(0, Math.min(items.length - 1, j));
      items.forEach((it, k) => it.setAttribute("tabindex", k === j ? "0" : "-1"));
      items[j].focus();
      if (o.onMove) o.onMove(items[j]);
    });
  };
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
  /* A box that scrolls (a wide table on a phone, a long list) can be scrolled from the keyboard: it joins the
     tab order while, and only while, its content overflows it and nothing inside it is in the tab order.
     Boxes are measured in a ResizeObserver's callback, which the browser runs right after its own layout:
     reading sizes there forces no extra layout (reading them from a timer made the browser lay the page out
     again for each box read). After a change to the page (batched) every box is observed afresh, so it is
     measured once more after the next layout; a box in a panel not laid out yet (content-visibility: auto,
     below the fold) is measured when its panel comes into view and its size changes. */
  const SCROLLERS = "main table, main pre, main ol, main ul, main [class*=scroll], main [class*=wrap], main .formula";
  const MAY_SCROLL = "table, pre, [class*=scroll], .formula";
  const FOCUSABLE = "a[href], button, input, select, textarea, [tabindex]:not([tabindex='-1'])";
  function measureBoxes(entries) {
    const join = [], leave = [];  // all reads first, then the writes
    for (const { target: el } of entries) {
      if (!el.isConnected) continue;
      const own = el.dataset.kvScroll === "1";
      const free = !el.hasAttribute("tabindex") && !el.querySelector(FOCUSABLE);
      const st = getComputedStyle(el);
      const scrolls = (/(auto|scroll)/.test(st.overflowX) && el.scrollWidth > el.clientWidth + 1) ||
        (/(auto|scroll)/.test(st.overflowY) && el.scrollHeight > el.clientHeight + 1);
      if (scrolls && free) join.push(el);
      else if (!scrolls && own) leave.push(el);
    }
    join.forEach((el) => { el.setAttribute("tabindex", "0"); el.dataset.kvScroll = "1"; });
    leave.forEach((el) => { el.removeAttribute("tabindex"); delete el.dataset.kvScroll; });
  }
  const boxes = window.ResizeObserver ? new ResizeObserver(measureBoxes) : null;
  let scrollTimer = null;
  const scrollSoon = () => {  // at most every 150 ms, and surely 150 ms after a change, however busy the page
    if (!scrollTimer && boxes) scrollTimer = setTimeout(() => {
      scrollTimer = null;
      const unseen = [];
      document.querySelectorAll(SCROLLERS).forEach((el) => {
        boxes.unobserve(el);
        boxes.observe(el);
        // Not laid out yet (its panel is below the fold): one that may scroll is reachable until it is measured.
        if (el.checkVisibility && el.checkVisibility() && !el.checkVisibility({ contentVisibilityAuto: true }) &&
            el.matches(MAY_SCROLL) && !el.hasAttribute("tabindex") && !el.querySelector(FOCUSABLE)) unseen.push(el);
      });
      unseen.forEach((el) => { el.setAttribute("tabindex", "0"); el.dataset.kvScroll = "1"; });
    }, 150);
  };
  document.addEventListener("DOMContentLoaded", () => {
    scrollSoon();
    const main = document.querySelector("main");
    if (main && window.MutationObserver) new MutationObserver(scrollSoon).observe(main, { childList: true, subtree: true });
    window.addEventListener("resize", scrollSoon);
  });
  /* A closed <details> may hold its content in a <template class="on-open">: inert (no style, no layout) until
     the reader opens it. A big page's first layout then covers only what is open. */
  document.addEventListener("toggle", (e) => {
    const d = e.target;
    if (!d.open || !d.querySelectorAll) return;
    d.querySelectorAll(":scope > template.on-open").forEach((t) => t.replaceWith(t.content));
  }, true);
  /* Page-wide behaviour (no inline handlers: the Content-Security-Policy allows no inline script). */
  document.addEventListener("click", function (e) {
    const t = e.target;
    // The page's address may have changed since it was rendered (htmx push, replaceState): go back to where we are now.
    const a = t.closest && t.closest("a[data-lang]");
    if (a) a.href = "/lang/" + a.dataset.lang + "?next=" + encodeURIComponent(location.pathname + location.search);
    const close = t.closest && t.closest("[data-dismiss]");
    if (close && close.parentElement) close.parentElement.remove();
  });
  document.addEventListener("htmx:configRequest", function (e) { e.detail.headers["X-KVScope-Lang"] = kv.lang; });
  // Forms driven entirely by a page script never submit themselves: their buttons act.
  document.addEventListener("submit", function (e) {
    if (e.target.matches && e.target.matches("form[data-no-submit]")) {
      e.preventDefault();
    }
  });
  // A new request from a form that says so clears the previous error message.
  document.addEventListener("htmx:beforeRequest", function (e) {
    const elt = e.detail && e.detail.elt;
    if (elt && elt.closest && elt.closest("[data-clears-error]")) {
      kv.clearError();
    }
  });

  /* Attention weights: white (0) to dark blue (1); masked cells show the tan plot background. */
  kv.WEIGHT_SCALE = [[0, "#ffffff"], [0.25, "#9ecae1"], [0.6, "#3182bd"], [1, "#08306b"]];
  /* Colour scales for weights in [0, 1]: f(w) in [0, 1] is where w falls on WEIGHT_SCALE. √ is the default:
     with ~100 tokens most weights are small and a linear map is nearly white. log spans 1e-4 … 1. */
  kv.SCALES = {
    linear: { f: (w) => w },
    sqrt: { f: (w) => Math.sqrt(Math.max(0, w)) },
    log: { f: (w) => Math.max(0, (Math.log10(Math.max(w, 1e-4)) + 4) / 4) },
  };
  const hex = (c) => [1, 3, 5].map((i) => parseInt(c.slice(i, i + 2), 16));
  const STOPS = kv.WEIGHT_SCALE.map(([at, c]) => [at, hex(c)]);  // parsed once: a heatmap asks 10⁵ times
  /* The colour of position t in [0, 1] on WEIGHT_SCALE, as [r, g, b]. */
  kv.weightColour = function (t) {
    t = Math.min(1, Math.max(0, t));
    for (let i = 1; i < STOPS.length; i++) {
      if (t <= STOPS[i][0]) {
        const [t0, a] = STOPS[i - 1], [t1, b] = STOPS[i], u = (t - t0) / (t1 - t0);
        return [Math.round(a[0] + (b[0] - a[0]) * u), Math.round(a[1] + (b[1] - a[1]) * u),
          Math.round(a[2] + (b[2] - a[2]) * u)];
      }
    }
    return STOPS[STOPS.length - 1][1].slice();
  };
  /* A Plotly colorscale over raw weights 0…1 that colours w like weightColour(f(w)): the cells keep their
     exact values (hover shows them), only the colour mapping bends. */
  kv.weightScale = function (name) {
    const f = kv.SCALES[name].f, stops = [], N = 40;
    for (let i = 0; i <= N; i++) {
      const w = name === "log" ? (i === 0 ? 0 : Math.pow(10, -4 + (4 * i) / N))
        : name === "sqrt" ? Math.pow(i / N, 2) : i / N;
      const c = kv.weightColour(f(w));
      if (!stops.length || w > stops[stops.length - 1][0]) stops.push([w, `rgb(${c.join(",")})`]);
    }
    stops[stops.length - 1][0] = 1;
    return stops;
  };
  /* One DOM builder for every page: kv.el("td", { class: "l", "data-k": 3 }, text or nodes…). */
  kv.el = function (tag, attrs, ...children) {
    const n = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") n.className = v;
      else if (k === "text") n.textContent = String(v);
      else n.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children) {
      if (c === null || c === undefined) continue;
      n.append(c instanceof Node ? c : String(c));
    }
    return n;
  };
  kv.MASK_COLOUR = "#e8d9b5";
  kv.MASK_RGB = [0xe8, 0xd9, 0xb5];
})();
