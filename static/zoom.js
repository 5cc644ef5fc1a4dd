/* The deep-zoom heatmap of one head (long prompts; the form that captures them is static/long.js).

   The map is drawn from tiles of a pyramid (app/viz/zoom.py): at view level v the tiles of pyramid level
   min(v, maxLevel) are drawn, each 256 × 256 cells of f × f exact weights pooled (max or mean); from maxLevel on
   every cell is one exact weight, and further levels only magnify (token labels appear once they fit).

        ┌ key positions (ticks, or tokens once they fit) ─────────────┐
        │ query   │ tiles: drawImage of a coloured 256² bitmap each    │  colour bar (HTML, beside)
        │ ticks   │ scaled to f · s px per cell (s: px per token)      │
        └─────────┴───────────────────────────────── minimap (overview + the view's frame)

   The view — layer, head, level, x, y (the token coordinates of the centre), pool, scale — lives in the URL.
   Wheel or +/− zoom (around the cursor), drag or the arrow keys pan, 0 resets; hover shows the query, the key,
   both tokens and the exact weight (asked from the cell endpoint). */
(function () {
  "use strict";
  const kv = window.kv;
  // Plot margins inside the canvas: query labels left (l: set from the widest label, labelMargin), key labels on top.
  const M = { l: 100, t: 72, r: 30, b: 8 };
  const LABEL_PX = 15;                         // px per token from which token texts replace position numbers
  const MAX_PX = 56;                           // the most px per token the deepest view level reaches
  const TILE_CACHE = 256;                      // coloured tiles kept (LRU)
  const FONT = "14px system-ui, sans-serif";

  function Zoom(root) {
    this.root = root;
    this.box = root.querySelector("#zoom-box");
    this.canvas = root.querySelector("#zoom-canvas");
    this.mini = root.querySelector("#zoom-minimap");
    this.hover = root.querySelector("#zoom-hover");
    this.status = root.querySelector("#zoom-status");
    this.key = root.dataset.key;
    const u = new URL(window.location.href).searchParams;
    const num = (name, dflt) => (u.has(name) && isFinite(+u.get(name)) ? +u.get(name) : dflt);
    this.embedded = !root.querySelector("#zoom-layer");
    this.layer = this.embedded ? +root.dataset.layer : num("layer", +root.dataset.layer);
    this.head = this.embedded ? +root.dataset.head : num("head", +root.dataset.head);
    this.pool = u.get("pool") === "mean" ? "mean" : "max";
    this.scale = kv.SCALES[u.get("scale")] ? u.get("scale") : "sqrt";
    this.want = { v: num("level", 0), x: num("x", null), y: num("y", null) };
    this.tiles = new Map();      // url -> {rows, cols, data, img} (LRU by insertion order)
    this.pending = new Map();    // url -> promise
    this.cellAsk = 0;
    this.drawn = 0;
  }

  /* The query labels' margin: as wide as the widest label the axis can draw ("text… 8191", the token cut as
     paintAxes cuts it), so no label is cut on the left ("omplete 3718"). */
  function tokenLabel(t) { return t.length > 9 ? t.slice(0, 8) + "…" : t; }
  Zoom.prototype.labelMargin = function () {
    const ctx = document.createElement("canvas").getContext("2d");
    ctx.font = FONT;
    const n = this.meta.rows, T = this.meta.tokens;
    let widest = ctx.measureText((n - 1).toLocaleString()).width;
    for (let q = 0; q < n; q++) widest = Math.max(widest, ctx.measureText(`${tokenLabel(T[q] || "")} ${q}`).width);
    M.l = Math.ceil(widest) + 14;  // the tick (5 px) and a gap (8 px) before the plot
  };
  Zoom.prototype.start = async function () {
    const m = (this.meta = await kv.getJSON(`/api/traces/${this.key}/zoom`));
    this.labelMargin();
    this.N = Math.max(m.rows, m.cols);
    this.maxLevel = m.levels - 1;
    this.resize();
    this.v = Math.min(this.maxView(), Math.max(0, Math.round(this.want.v)));
    this.cx = this.want.x === null ? this.N / 2 : this.want.x;
    this.cy = this.want.y === null ? this.N / 2 : this.want.y;
    this.clamp();
    this.bind();
    this.paintBar();
    this.syncControls();
    this.draw();
  };

  /* --- geometry -------------------------------------------------------------------------------------- */
  Zoom.prototype.resize = function () {
    // As tall as the window allows (a projector's 720 px too), the plot square: the colour bar sits beside it.
    const stage = this.root.querySelector(".zoom-stage"), yTitle = this.root.querySelector(".zoom-axis-y");
    const bar = this.root.querySelector(".zoom-bar");
    const avail = stage.clientWidth - (yTitle ? yTitle.offsetWidth : 0) - (bar ? bar.offsetWidth : 0) - 24;
    const side = Math.round(Math.max(260, Math.min(avail - M.l - M.r, window.innerHeight - 190 - M.t - M.b, 1000)));
    const w = side + M.l + M.r, h = side + M.t + M.b;
    this.box.style.width = w + "px";
    const xTitle = this.root.querySelector(".zoom-axis-x");
    if (xTitle) xTitle.style.paddingLeft = M.l + "px";  // centred over the plot, whatever the labels' margin
    const dpr = window.devicePixelRatio || 1;
    this.W = w; this.H = h;
    this.canvas.width = Math.round(w * dpr); this.canvas.height = Math.round(h * dpr);
    this.canvas.style.width = w + "px"; this.canvas.style.height = h + "px";
    this.dpr = dpr;
    this.pw = w - M.l - M.r; this.ph = h - M.t - M.b;
    const ms = Math.round(Math.min(170, Math.max(110, Math.min(this.pw, this.ph) * 0.24)));
    this.mini.width = Math.round(ms * dpr); this.mini.height = Math.round(ms * dpr);
    this.mini.style.width = ms + "px"; this.mini.style.height = ms + "px";
    this.mini.style.left = (M.l + this.pw - ms - 10) + "px"; this.mini.style.top = (M.t + this.ph - ms - 10) + "px";
    this.ms = ms;
  };
  Zoom.prototype.fit = function () { return Math.min(this.pw, this.ph) / this.N; };
  Zoom.prototype.px = function (v) { return this.fit() * Math.pow(2, v === undefined ? this.v : v); };
  Zoom.prototype.maxView = function () {
    return Math.max(this.maxLevel, Math.ceil(Math.log2(MAX_PX / this.fit())));
  };
  Zoom.prototype.clamp = function () {
    this.cx = Math.min(this.N, Math.max(0, this.cx));
    this.cy = Math.min(this.N, Math.max(0, this.cy));
  };
  Zoom.prototype.origin = function () {
    const s = this.px();
    return { s, x0: this.cx - this.pw / (2 * s), y0: this.cy - this.ph / (2 * s) };
  };
  /* The token pair under a point of the canvas (CSS px), or null outside the map. */
  Zoom.prototype.at = function (px, py) {
    const { s, x0, y0 } = this.origin();
    if (px < M.l || py < M.t || px > M.l + this.pw || py > M.t + this.ph) return null;
    const k = Math.floor(x0 + (px - M.l) / s), q = Math.floor(y0 + (py - M.t) / s);
    if (q < 0 || k < 0 || q >= this.meta.rows || k >= this.meta.cols) return null;
    return { q, k };
  };

  /* --- tiles --------------------------------------------------------------------------------------- */
  Zoom.prototype.url = function (level, row, col) {
    return `/api/traces/${this.key}/zoom/${this.layer}/${this.head}/${level}/${row}/${col}?pool=${this.pool}`;
  };
  Zoom.prototype.tile = function (level, row, col) {
    const url = this.url(level, row, col);
    const hit = this.tiles.get(url);
    if (hit) { this.tiles.delete(url); this.tiles.set(url, hit); return hit; }
    if (!this.pending.has(url)) {
      const p = fetch(url, { headers: { "X-KVScope-Lang": kv.lang } }).then(async (r) => {
        if (!r.ok) {
          let d = null; try { d = await r.json(); } catch (e) { d = null; }
          kv.showError((d && d.detail) || kv.t("js.error.request_failed", { status: r.status }));
          return;
        }
        const rows = +r.headers.get("X-Tile-Rows"), cols = +r.headers.get("X-Tile-Cols");
        const data = new Float32Array(await r.arrayBuffer());
        this.tiles.set(url, { level, row, col, rows, cols, data, img: null, imgScale: null });
        while (this.tiles.size > TILE_CACHE) this.tiles.delete(this.tiles.keys().next().value);
      }).catch(() => kv.showError(kv.t("js.error.unreachable"))).finally(() => {
        this.pending.delete(url);
        this.draw();
      });
      this.pending.set(url, p);
    }
    return null;
  };
  /* The tile coloured as a bitmap of one pixel per cell (made again when the colour scale changes). Cells wholly
     in the future of every query they cover are the causal mask's: the mask colour. */
  Zoom.prototype.image = function (t) {
    if (t.img && t.imgScale === this.scale) return t.img;
    const f = Math.pow(2, this.maxLevel - t.level), span = 256 * f, past = this.meta.past;
    const c = document.createElement("canvas");
    c.width = t.cols; c.height = t.rows;
    const ctx = c.getContext("2d"), im = ctx.createImageData(t.cols, t.rows), px = im.data;
    const g = kv.SCALES[this.scale].f, lut = new Uint8Array(256 * 3);
    for (let i = 0; i < 256; i++) { const rgb = kv.weightColour(i / 255); lut.set(rgb, i * 3); }
    const r0 = t.row * span, c0 = t.col * span;
    for (let i = 0; i < t.rows; i++) {
      const lastQuery = past + Math.min(this.meta.rows, r0 + (i + 1) * f) - 1;
      for (let j = 0; j < t.cols; j++) {
        const o = (i * t.cols + j) * 4;
        if (c0 + j * f > lastQuery) {
          px[o] = kv.MASK_RGB[0]; px[o + 1] = kv.MASK_RGB[1]; px[o + 2] = kv.MASK_RGB[2];
        } else {
          const at = Math.round(255 * Math.min(1, Math.max(0, g(t.data[i * t.cols + j])))) * 3;
          px[o] = lut[at]; px[o + 1] = lut[at + 1]; px[o + 2] = lut[at + 2];
        }
        px[o + 3] = 255;
      }
    }
    ctx.putImageData(im, 0, 0);
    t.img = c; t.imgScale = this.scale;
    return c;
  };

  /* --- drawing ------------------------------------------------------------------------------------- */
  Zoom.prototype.draw = function () {
    if (this.frame) return;
    this.frame = requestAnimationFrame(() => { this.frame = null; this.paint(); });
  };
  Zoom.prototype.paint = function () {
    const ctx = this.canvas.getContext("2d");
    ctx.setTransform(this.dpr, 0, 0, this.dpr, 0, 0);
    ctx.clearRect(0, 0, this.W, this.H);
    ctx.fillStyle = "#ffffff";
    ctx.fillRect(0, 0, this.W, this.H);
    const { s, x0, y0 } = this.origin();
    ctx.save();
    ctx.beginPath(); ctx.rect(M.l, M.t, this.pw, this.ph); ctx.clip();
    ctx.fillStyle = "#f3f4f6"; ctx.fillRect(M.l, M.t, this.pw, this.ph);
    ctx.imageSmoothingEnabled = false;
    // The overview underneath (always at hand), then the tiles of this view's level over it.
    const overview = this.tile(0, 0, 0);
    let missing = overview ? 0 : 1;
    const level = Math.min(this.v, this.maxLevel);
    const blit = (t, lv) => {
      const f = Math.pow(2, this.maxLevel - lv), span = 256 * f;
      ctx.drawImage(this.image(t), M.l + (t.col * span - x0) * s, M.t + (t.row * span - y0) * s, t.cols * f * s, t.rows * f * s);
    };
    if (overview) blit(overview, 0);
    if (level > 0) {
      const span = 256 * Math.pow(2, this.maxLevel - level);
      const rMax = Math.ceil(this.meta.rows / span) - 1, cMax = Math.ceil(this.meta.cols / span) - 1;
      const r0 = Math.max(0, Math.floor(y0 / span)), r1 = Math.min(rMax, Math.floor((y0 + this.ph / s) / span));
      const c0 = Math.max(0, Math.floor(x0 / span)), c1 = Math.min(cMax, Math.floor((x0 + this.pw / s) / span));
      for (let r = r0; r <= r1; r++) {
        for (let c = c0; c <= c1; c++) {
          const t = this.tile(level, r, c);
          if (t) blit(t, level); else missing++;
        }
      }
    }
    this.paintHover(ctx, s, x0, y0);
    ctx.restore();
    ctx.strokeStyle = "#9aa3ae"; ctx.lineWidth = 1;
    ctx.strokeRect(M.l - 0.5, M.t - 0.5, this.pw + 1, this.ph + 1);
    this.paintAxes(ctx, s, x0, y0);
    this.paintMini();
    const f = Math.pow(2, this.maxLevel - level);
    this.status.textContent = kv.t(f > 1 ? "js.zoom.status_pooled" : "js.zoom.status_exact", {
      level: this.v, levels: this.maxView(), f, pool: this.pool === "mean" ? kv.t("js.zoom.pool_mean") : kv.t("js.zoom.pool_max"), n: this.meta.rows,
      from: Math.max(0, Math.floor(y0)), to: Math.min(this.meta.rows, Math.ceil(y0 + this.ph / s)) - 1,
      kfrom: Math.max(0, Math.floor(x0)), kto: Math.min(this.meta.cols, Math.ceil(x0 + this.pw / s)) - 1,
    });
    root_label(this);
    if (!missing) {  // every tile of this view is on screen: counted for tests and benchmarks
      this.drawn++;
      document.body.dataset.zoomDrawn = String(this.drawn);
      document.body.dataset.zoomView = `${this.layer}/${this.head}/${this.v}/${this.pool}`;
    }
  };
  function root_label(z) {
    const label = z.root.querySelector("#zoom-label");
    if (label) label.textContent = kv.t("js.zoom.label", { layer: z.layer, head: z.head, rows: z.meta.rows.toLocaleString(), cols: z.meta.cols.toLocaleString() });
  }
  Zoom.prototype.paintHover = function (ctx, s, x0, y0) {
    if (!this.hovered) return;
    const { q, k } = this.hovered;
    const x = M.l + (k - x0) * s, y = M.t + (q - y0) * s;
    ctx.strokeStyle = "rgba(208, 138, 0, 0.9)"; ctx.lineWidth = 2;
    if (s >= 4) ctx.strokeRect(x - 1, y - 1, s + 2, s + 2);
    ctx.setLineDash([4, 4]); ctx.lineWidth = 1;
    ctx.beginPath();
    ctx.moveTo(M.l, y + s / 2); ctx.lineTo(x, y + s / 2);        // the query's row, up to the cell
    ctx.moveTo(x + s / 2, M.t); ctx.lineTo(x + s / 2, y);        // the key's column, down to it
    ctx.stroke(); ctx.setLineDash([]);
  };
  /* Position numbers at a round step, or the tokens themselves once a token is LABEL_PX wide. */
  Zoom.prototype.paintAxes = function (ctx, s, x0, y0) {
    ctx.font = FONT; ctx.fillStyle = "#1f2933"; ctx.strokeStyle = "#6b7280";
    const tokens = s >= LABEL_PX, T = this.meta.tokens;
    const cut = tokenLabel;
    const visible = (lo, len, n) => [Math.max(0, Math.floor(lo)), Math.min(n - 1, Math.ceil(lo + len / s))];
    let step = 1;
    if (!tokens) {
      const rough = 70 / s, base = Math.pow(10, Math.floor(Math.log10(rough))), m = rough / base;
      step = Math.max(1, (m <= 2 ? 2 : m <= 5 ? 5 : 10) * base);
    }
    const [q0, q1] = visible(y0, this.ph, this.meta.rows), [k0, k1] = visible(x0, this.pw, this.meta.cols);
    ctx.textBaseline = "middle"; ctx.textAlign = "right";
    for (let q = Math.ceil(q0 / step) * step; q <= q1; q += step) {
      const y = M.t + (q - y0 + (tokens ? 0.5 : 0)) * s;
      if (y < M.t - 1 || y > M.t + this.ph + 1) continue;
      ctx.fillText(tokens ? `${cut(T[q])} ${q}` : q.toLocaleString(), M.l - 8, y);
      ctx.beginPath(); ctx.moveTo(M.l - 5, y); ctx.lineTo(M.l, y); ctx.stroke();
    }
    for (let k = Math.ceil(k0 / step) * step; k <= k1; k += step) {
      const x = M.l + (k - x0 + (tokens ? 0.5 : 0)) * s;
      if (x < M.l - 1 || x > M.l + this.pw + 1) continue;
      ctx.beginPath(); ctx.moveTo(x, M.t - 5); ctx.lineTo(x, M.t); ctx.stroke();
      ctx.save(); ctx.translate(x, M.t - 8);
      if (tokens) { ctx.rotate(-Math.PI / 3); ctx.textAlign = "left"; ctx.fillText(`${k} ${cut(T[k - this.meta.past] || "")}`, 0, 0); }
      else { ctx.textAlign = "center"; ctx.textBaseline = "bottom"; ctx.fillText(k.toLocaleString(), 0, 0); }
      ctx.restore(); ctx.textBaseline = "middle";
    }
  };
  Zoom.prototype.paintMini = function () {
    this.mini.hidden = this.v === 0;  // the whole map is on screen already
    if (this.mini.hidden) return;
    const ctx = this.mini.getContext("2d"), n = this.ms, k = n / this.N;
    ctx.setTransform(this.dpr, 0, 0, this.dpr, 0, 0);
    ctx.fillStyle = "#ffffff"; ctx.fillRect(0, 0, n, n);
    const t = this.tiles.get(this.url(0, 0, 0));
    if (t) {
      ctx.imageSmoothingEnabled = true;
      const f = Math.pow(2, this.maxLevel);
      ctx.drawImage(this.image(t), 0, 0, t.cols * f * k, t.rows * f * k);
    }
    const { s, x0, y0 } = this.origin();
    ctx.strokeStyle = "#d08a00"; ctx.lineWidth = 2;
    ctx.strokeRect(Math.max(1, x0 * k), Math.max(1, y0 * k), Math.max(3, Math.min(n - 2, (this.pw / s) * k)),
      Math.max(3, Math.min(n - 2, (this.ph / s) * k)));
    ctx.strokeStyle = "#6b7280"; ctx.lineWidth = 1; ctx.strokeRect(0.5, 0.5, n - 1, n - 1);
  };
  /* The colour bar: the scale's colours from 0 (bottom) to 1 (top), ticks at round weights. */
  Zoom.prototype.paintBar = function () {
    const bar = this.root.querySelector("#zoom-bar"), ticks = this.root.querySelector("#zoom-bar-ticks");
    if (!bar) return;
    const ctx = bar.getContext("2d"), h = bar.height, g = kv.SCALES[this.scale].f;
    for (let y = 0; y < h; y++) {
      const rgb = kv.weightColour(1 - y / (h - 1));
      ctx.fillStyle = `rgb(${rgb.join(",")})`; ctx.fillRect(0, y, bar.width, 1);
    }
    ticks.textContent = "";
    let last = -1;
    for (const w of [0, 0.0001, 0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 1]) {
      const at = g(w);
      if (w > 0 && at - last < 0.08) continue;
      last = at;
      ticks.append(kv.el("span", { style: `bottom: calc(${(100 * at).toFixed(2)}% - 0.6em)` }, w === 0 ? "0" : String(w)));
    }
    const mask = this.root.querySelector(".zoom-bar-mask");
    if (mask) mask.style.background = kv.MASK_COLOUR;
  };

  /* --- view changes --------------------------------------------------------------------------------- */
  Zoom.prototype.zoomTo = function (v, px, py) {
    v = Math.min(this.maxView(), Math.max(0, v));
    if (v === this.v) return;
    if (px !== undefined) {  // keep the token under the point where it is
      const before = this.origin(), tx = before.x0 + (px - M.l) / before.s, ty = before.y0 + (py - M.t) / before.s;
      this.v = v;
      const s = this.px();
      this.cx = tx - (px - M.l) / s + this.pw / (2 * s);
      this.cy = ty - (py - M.t) / s + this.ph / (2 * s);
    } else {
      this.v = v;
    }
    this.changed();
  };
  Zoom.prototype.pan = function (dx, dy) {  // in CSS px
    const s = this.px();
    this.cx -= dx / s; this.cy -= dy / s;
    this.changed();
  };
  Zoom.prototype.changed = function () {
    this.clamp();
    this.hovered = null;
    this.draw();
    clearTimeout(this.urlTimer);
    this.urlTimer = setTimeout(() => this.syncUrl(), 120);
  };
  Zoom.prototype.syncUrl = function () {
    const u = new URL(window.location.href);
    if (!this.embedded) { u.searchParams.set("layer", this.layer); u.searchParams.set("head", this.head); }
    u.searchParams.set("level", this.v);
    u.searchParams.set("x", Math.round(this.cx));
    u.searchParams.set("y", Math.round(this.cy));
    u.searchParams.set("pool", this.pool);
    u.searchParams.set("scale", this.scale);
    window.history.replaceState(null, "", u.toString());
  };
  Zoom.prototype.select = function (change) {
    Object.assign(this, change);
    this.hovered = null;
    this.paintBar();
    this.syncControls();
    this.changed();
  };
  Zoom.prototype.syncControls = function () {
    const set = (id, v) => { const e = this.root.querySelector(id); if (e) e.value = v; };
    set("#zoom-layer", this.layer); set("#zoom-head", this.head); set("#zoom-scale", this.scale);
    this.root.querySelectorAll("input[name=zoom-pool]").forEach((e) => { e.checked = e.value === this.pool; });
  };

  /* --- hover: the exact weight from the cell endpoint ----------------------------------------------- */
  Zoom.prototype.showHover = function (cell) {
    if (!cell) { this.hovered = null; this.draw(); return; }
    if (this.hovered && this.hovered.q === cell.q && this.hovered.k === cell.k) return;
    this.hovered = cell;
    this.draw();
    const T = this.meta.tokens, ask = ++this.cellAsk;
    const pooled = this.pooledAt(cell);
    this.hover.textContent = kv.t("js.zoom.hover", { q: cell.q, qt: T[cell.q], k: cell.k, kt: T[cell.k - this.meta.past] || "" }) +
      (pooled ? " · " + pooled : "") + " · " + kv.t("js.zoom.asking");
    clearTimeout(this.cellTimer);
    this.cellTimer = setTimeout(async () => {
      let c;
      try { c = await kv.getJSON(`/api/traces/${this.key}/zoom/${this.layer}/${this.head}/cell?q=${cell.q}&k=${cell.k}`); }
      catch (e) { return; }
      if (ask !== this.cellAsk) return;
      const w = c.allowed ? kv.t("js.zoom.weight", { w: c.weight.toPrecision(6) }) : kv.t("js.zoom.masked");
      this.hover.textContent = kv.t("js.zoom.hover", { q: c.q, qt: c.query_token, k: c.k, kt: c.key_token || "" }) +
        (pooled ? " · " + pooled : "") + " · " + w;
      Object.assign(this.hover.dataset, { q: c.q, k: c.k, weight: String(c.weight), layer: c.layer, head: c.head });
    }, 60);
  };
  /* The keys one query reads most (the top endpoint: token texts and exact weights), under the map. */
  Zoom.prototype.showTop = async function (q) {
    const box = this.root.querySelector("#zoom-top");
    if (!box) return;
    const ask = (this.topAsk = (this.topAsk || 0) + 1);
    box.textContent = kv.t("js.zoom.top_asking", { q });
    let t;
    try { t = await kv.getJSON(`/api/traces/${this.key}/zoom/${this.layer}/${this.head}/top?q=${q}`); } catch (e) { return; }
    if (ask !== this.topAsk) return;
    box.textContent = "";
    box.append(kv.el("p", null, kv.t("js.zoom.top_title", { q: t.q, qt: t.query_token, layer: t.layer, head: t.head })));
    const list = kv.el("ol");
    for (const k of t.keys) {
      const li = kv.el("li", { "data-k": k.pos, "data-weight": k.weight }, kv.t("js.zoom.top_key", { k: k.pos, kt: k.token, w: "" }));
      li.append(kv.el("span", { class: "top-w" }, k.weight.toFixed(4)));
      list.append(li);
    }
    box.append(list);
    box.dataset.q = String(t.q);
  };
  /* The pooled cell's value under the pointer, while one cell covers several weights. */
  Zoom.prototype.pooledAt = function (cell) {
    const level = Math.min(this.v, this.maxLevel), f = Math.pow(2, this.maxLevel - level);
    if (f === 1) return "";
    const span = 256 * f, t = this.tiles.get(this.url(level, Math.floor(cell.q / span), Math.floor(cell.k / span)));
    if (!t) return "";
    const i = Math.floor((cell.q % span) / f), j = Math.floor((cell.k % span) / f);
    const vars = { f, w: t.data[i * t.cols + j].toPrecision(4) };
    return this.pool === "mean" ? kv.t("js.zoom.pooled_mean", vars) : kv.t("js.zoom.pooled_max", vars);
  };

  /* --- input ---------------------------------------------------------------------------------------- */
  Zoom.prototype.bind = function () {
    const box = this.box, pos = (e) => { const r = this.canvas.getBoundingClientRect(); return [e.clientX - r.left, e.clientY - r.top]; };
    let wheel = 0;
    box.addEventListener("wheel", (e) => {
      e.preventDefault();
      wheel += e.deltaMode === 1 ? e.deltaY * 33 : e.deltaY;
      if (Math.abs(wheel) < 60) return;
      const [px, py] = pos(e);
      this.zoomTo(this.v + (wheel < 0 ? 1 : -1), px, py);
      wheel = 0;
    }, { passive: false });
    let drag = null;
    this.canvas.addEventListener("pointerdown", (e) => {
      drag = { x: e.clientX, y: e.clientY, moved: false };
      this.canvas.setPointerCapture(e.pointerId);
      box.focus({ preventScroll: true });
    });
    this.canvas.addEventListener("pointermove", (e) => {
      if (drag) {
        const dx = e.clientX - drag.x, dy = e.clientY - drag.y;
        if (dx || dy) { drag.moved = true; drag.x = e.clientX; drag.y = e.clientY; this.pan(dx, dy); }
        return;
      }
      const [px, py] = pos(e);
      this.showHover(this.at(px, py));
    });
    const end = (e) => { if (drag) { try { this.canvas.releasePointerCapture(e.pointerId); } catch (x) { /* gone */ } } drag = null; };
    this.canvas.addEventListener("pointerup", (e) => {
      const click = drag && !drag.moved;
      end(e);
      if (click) { const [px, py] = pos(e), cell = this.at(px, py); if (cell) this.showTop(cell.q); }
    });
    this.canvas.addEventListener("pointercancel", end);
    this.canvas.addEventListener("pointerleave", () => { if (!drag) this.showHover(null); });
    box.addEventListener("keydown", (e) => {
      const step = 0.25, k = e.key;
      if (k === "+" || k === "=") this.zoomTo(this.v + 1);
      else if (k === "-" || k === "_") this.zoomTo(this.v - 1);
      else if (k === "ArrowLeft") this.pan(this.pw * step, 0);
      else if (k === "ArrowRight") this.pan(-this.pw * step, 0);
      else if (k === "ArrowUp") this.pan(0, this.ph * step);
      else if (k === "ArrowDown") this.pan(0, -this.ph * step);
      else if (k === "0" || k === "Home") this.reset();
      else return;
      e.preventDefault();
    });
    const miniGo = (e) => {
      const r = this.mini.getBoundingClientRect(), k = this.N / this.ms;
      this.cx = (e.clientX - r.left) * k; this.cy = (e.clientY - r.top) * k;
      this.changed();
    };
    let miniDrag = false;
    this.mini.addEventListener("pointerdown", (e) => { miniDrag = true; this.mini.setPointerCapture(e.pointerId); miniGo(e); e.stopPropagation(); });
    this.mini.addEventListener("pointermove", (e) => { if (miniDrag) miniGo(e); });
    this.mini.addEventListener("pointerup", () => { miniDrag = false; });
    const on = (sel, ev, fn) => { const el = this.root.querySelector(sel); if (el) el.addEventListener(ev, fn); };
    on("#zoom-in", "click", () => this.zoomTo(this.v + 1));
    on("#zoom-out", "click", () => this.zoomTo(this.v - 1));
    on("#zoom-reset", "click", () => this.reset());
    on("#zoom-layer", "change", (e) => this.select({ layer: +e.target.value }));
    on("#zoom-head", "change", (e) => this.select({ head: +e.target.value }));
    on("#zoom-scale", "change", (e) => this.select({ scale: e.target.value }));
    this.root.querySelectorAll("input[name=zoom-pool]").forEach((el) =>
      el.addEventListener("change", (e) => this.select({ pool: e.target.value })));
    if (this.embedded) {  // Inspect's own selects drive the head; its scale select the colours
      document.body.addEventListener("kv-zoom-head", (e) => {
        if (e.detail.layer !== this.layer || e.detail.head !== this.head) this.select({ layer: e.detail.layer, head: e.detail.head });
      });
      const sc = document.getElementById("sel-scale");
      if (sc) { this.scale = kv.SCALES[sc.value] ? sc.value : this.scale; sc.addEventListener("change", (e) => this.select({ scale: e.target.value })); }
    }
    let resizeTimer = null;
    window.addEventListener("resize", () => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(() => { this.resize(); this.v = Math.min(this.v, this.maxView()); this.draw(); }, 100);
    });
  };
  Zoom.prototype.reset = function () {
    this.v = 0; this.cx = this.N / 2; this.cy = this.N / 2;
    this.changed();
  };

  function init() {
    const root = document.getElementById("zoom");
    if (!root || root.dataset.bound) return;
    root.dataset.bound = "1";
    const z = new Zoom(root);
    window.kvZoom = z;  // for the page's tests and benchmarks
    z.start();
  }
  window.kv.page("inspect", (page) => page.view("zoom", init));  // Inspect past zoom_min_tokens, and /zoom/{key}
})();
