/* Inspect while its prompt is captured: each layer's attention as soon as the model has computed it. The server
   streams one part per layer (app/web/render.py render_in_parts, app/labs/inspect.py page_in_parts):
   <script type="application/json" class="kv-layer"> then <i class="kv-layer-end">, after the climb's block
   (templates/partials/_climb_stream.html). One painter (kv.climbOn) draws them: the layer's row of the all-heads
   grid, the status line, and the first head's matrix drawn from the first layer that has it. The bytes are the
   finished trace's (grid: round(255·√w) max-pooled; a head: the first paint's sqrt-u8), so nothing drawn here is
   replaced by other numbers; inspect.js takes them over (window.kv.climb) once the view has arrived.

   Two ways the parts reach it:
   - a page opened by URL: this script runs as the page is parsed (not deferred: the page's other scripts run once
     it is all there), so it watches the parser add them. A capture that stops leaves the block hidden with the
     page's pending line (style.css: once .view-end is parsed).
   - a prompt typed into the page's form: htmx sends it (marked X-KVScope-Climb, so the server streams the climb
     without the page around it) and this script reads htmx's answer as it arrives (the XHR's progress): the climb
     takes #result's place at once, its layers are painted as they come, and htmx swaps in the view, as it always
     did (the URL pushed, the indicator, the events inspect.js and the lesson wait on). The view before is hidden
     meanwhile, not removed, so a capture that fails after its first layers leaves it as it was and its message in the page's
     banner, as a refusal before any layer does. */
(function () {
  "use strict";
  const kv = (window.kv = window.kv || {});
  if (kv.climbOn) return;  // the page's deferred bundle, after the parser already ran this for a streamed page

  /* The painter of one climb: `box` the #climb block (in the page or not yet), `scale` the colour scale's name. */
  kv.climbOn = function (box, scale) {
    const root = box.closest(".capture-pending") || box, line = box.querySelector("#climb-line");
    const heat = box.querySelector("#climb-heat"), label = box.querySelector("#climb-head-label");
    const H = +box.dataset.heads, L = +box.dataset.layers;
    const want = box.dataset.layer === "" ? null : `${box.dataset.layer}/${box.dataset.head || 0}`;
    const f = (kv.SCALES[scale] || kv.SCALES.sqrt).f;
    const climb = (kv.climb = { key: box.dataset.key, layers: {}, heads: {}, side: 0, n_layer: L, n_head: H,
      drawn: null, picked: null, done: false });
    delete document.body.dataset.climbLayers;
    delete document.body.dataset.climbHead;
    // byte b -> the colour of the weight (b / 255)² on the page's scale (the grid's and the heatmap's colours)
    const lut = new Uint8ClampedArray(256 * 3);
    for (let b = 0; b < 256; b++) {
      const [r, g, bl] = kv.weightColour(f(kv.fromSqrtU8(b)));
      lut[3 * b] = r; lut[3 * b + 1] = g; lut[3 * b + 2] = bl;
    }
    const bytes = (b64) => Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));

    function paintRow(part, data) {
      const side = part.side, n = side * side;
      const c = document.createElement("canvas");
      c.width = side * H; c.height = side;
      const ctx = c.getContext("2d"), img = ctx.createImageData(side, side);
      for (let h = 0; h < H; h++) {
        for (let i = 0; i < n; i++) {
          const v = data[h * n + i], o = 4 * i;
          img.data[o] = lut[3 * v]; img.data[o + 1] = lut[3 * v + 1]; img.data[o + 2] = lut[3 * v + 2]; img.data[o + 3] = 255;
        }
        ctx.putImageData(img, h * side, 0);
      }
      const url = c.toDataURL();
      box.querySelectorAll(`.head-cell[data-layer="${part.layer}"]`).forEach((cell) => {
        const h = +cell.dataset.head;
        cell.style.backgroundImage = `url(${url})`;
        cell.style.backgroundSize = `${H * 100}% 100%`;
        cell.style.backgroundPosition = `${H > 1 ? (100 * h) / (H - 1) : 0}% 0`;
        cell.classList.add("ready");
        cell.tabIndex = 0;
      });
    }

    /* One head's cells (lower triangle, row i holding past + i + 1 keys) on a canvas, one pixel a cell. */
    function paintHead(m) {
      const c = document.createElement("canvas");
      c.width = m.cols; c.height = m.rows;
      const ctx = c.getContext("2d"), img = ctx.createImageData(m.cols, m.rows), d = img.data, v = bytes(m.data);
      const mask = kv.MASK_RGB;
      let s = 0;
      for (let i = 0; i < m.rows; i++) {
        const n = Math.min(m.cols, m.past + i + 1);
        for (let j = 0; j < m.cols; j++) {
          const o = 4 * (i * m.cols + j);
          d[o + 3] = 255;
          if (j < n) { const b = v[s + j]; d[o] = lut[3 * b]; d[o + 1] = lut[3 * b + 1]; d[o + 2] = lut[3 * b + 2]; }
          else { d[o] = mask[0]; d[o + 1] = mask[1]; d[o + 2] = mask[2]; }
        }
        s += n;
      }
      ctx.putImageData(img, 0, 0);
      c.className = "climb-canvas";
      heat.replaceChildren(c);
      label.textContent = box.dataset.headLabel.replace("{layer}", m.layer).replace("{head}", m.head);
      climb.drawn = `${m.layer}/${m.head}`;
      document.body.dataset.climbHead = climb.drawn;
    }

    function apply(part) {
      const data = bytes(part.grid);
      climb.side = part.side;
      climb.layers[part.layer] = data;
      root.classList.add("climbing");
      line.textContent = part.line;
      paintRow(part, data);
      for (const m of part.heads) climb.heads[`${m.layer}/${m.head}`] = m;
      // The first head from the first layer that has one; then the head the URL names once its layer is in.
      for (const m of part.heads) {
        const at = `${m.layer}/${m.head}`;
        if (!climb.drawn || (at === want && climb.drawn !== want && !climb.picked)) paintHead(m);
      }
      document.body.dataset.climbLayers = String(Object.keys(climb.layers).length);
    }

    /* A ready cell clicked: the head the view opens on when the capture is done (nothing is drawn before: its
       matrix is the finished trace's to send). */
    box.addEventListener("click", (e) => {
      const cell = e.target.closest && e.target.closest(".head-cell.ready");
      if (!cell) return;
      climb.picked = { layer: +cell.dataset.layer, head: +cell.dataset.head };
      box.querySelectorAll(".head-cell.sel").forEach((c) => c.classList.remove("sel"));
      cell.classList.add("sel");
    });
    box.addEventListener("keydown", (e) => {
      if ((e.key === "Enter" || e.key === " ") && e.target.classList.contains("ready")) { e.preventDefault(); e.target.click(); }
    });

    /* The view (or its error) is in: the climb goes, its ids (the token strip's) with it; what it drew stays in
       kv.climb for inspect.js. */
    function finish() {
      climb.done = true;
      root.classList.remove("climbing");
      box.remove();
    }
    return { apply, finish, root };
  };

  const PART = '<script type="application/json" class="kv-layer">', PART_END = '<i class="kv-layer-end"></i>';
  const STREAM = '<div class="view-stream">', VIEW_END = '<i class="view-end"></i>';

  // --- a page opened by URL: the parser adds the parts ------------------------------------------------------------
  const box = document.getElementById("climb");
  if (box && document.readyState === "loading") {
    const painter = kv.climbOn(box, new URL(window.location.href).searchParams.get("scale"));
    const watch = new MutationObserver((records) => {
      for (const r of records) {
        for (const node of r.addedNodes) {
          if (node.nodeType !== 1) continue;
          if (node.classList.contains("kv-layer-end")) {
            const script = node.previousElementSibling;
            if (script && script.classList.contains("kv-layer")) painter.apply(JSON.parse(script.textContent));
          } else if (node.classList.contains("view-end")) {
            painter.finish();  // a capture that stopped leaves nothing of it
            watch.disconnect();
          }
        }
      }
    });
    watch.observe(painter.root.parentNode, { childList: true, subtree: true });
  }

  // --- a prompt typed into the page's form: htmx's answer read as it arrives -----------------------------------
  let run = null;  // the form's request in flight: {xhr, url, seen, painter, pending, before}
  const ours = (d) => d && d.elt && d.elt.id === "prompt-form" && document.getElementById("result");

  document.addEventListener("htmx:configRequest", (e) => {
    if (ours(e.detail) && (e.detail.verb || "get") === "get") e.detail.headers["X-KVScope-Climb"] = "1";
  });
  document.addEventListener("htmx:beforeSend", (e) => {
    const d = e.detail;
    if (!ours(d) || !d.xhr) return;
    const mine = (run = { xhr: d.xhr, url: d.pathInfo.finalRequestPath, seen: 0, painter: null, pending: null, before: null });
    d.xhr.addEventListener("progress", () => { if (run === mine) read(mine); });
  });

  /* What has arrived of the answer: the climb's block once it is all in (it takes #result's place), then each
     layer part complete so far. A refusal (not 200) or an answer without the climb is htmx's alone. */
  function read(mine) {
    const xhr = mine.xhr;
    if (xhr.status !== 200) return;
    const text = xhr.responseText;
    if (!mine.painter) {
      const at = text.indexOf(STREAM);
      if (at < 0) return;
      const t = document.createElement("template");
      t.innerHTML = text.slice(0, at);
      const pending = t.content.getElementById("capture-pending"), box = t.content.getElementById("climb");
      if (!pending || !box) { mine.seen = -1; return; }
      // The view before stays where it is, hidden (a chart of it still being drawn finds its element), the climb
      // before it (so the ids the two share, the token strip's, name the climb's while it runs).
      const result = document.getElementById("result");
      mine.before = Array.from(result.children).filter((el) => !el.hidden);
      mine.before.forEach((el) => { el.hidden = true; });
      result.prepend(pending);
      mine.pending = pending;
      mine.painter = kv.climbOn(box, new URL(mine.url, window.location.href).searchParams.get("scale"));
      mine.seen = at + STREAM.length;
    }
    for (let end = text.indexOf(PART_END, mine.seen); end >= 0; end = text.indexOf(PART_END, mine.seen)) {
      const start = text.lastIndexOf(PART, end) + PART.length;
      mine.painter.apply(JSON.parse(text.slice(start, text.lastIndexOf("</script>", end))));
      mine.seen = end + PART_END.length;
    }
  }

  /* The view before the climb shown again as it was (htmx's history keeps it; its scripts' state still holds it). */
  function putBack(mine) {
    if (mine.pending) mine.pending.remove();
    if (mine.before) mine.before.forEach((el) => { el.hidden = false; });
  }

  document.addEventListener("htmx:beforeSwap", (e) => {
    const d = e.detail;
    if (!run || d.xhr !== run.xhr) return;
    const mine = run;
    run = null;
    if (d.xhr.status !== 200) return;  // refused before the capture: the message in the banner (HX-Retarget)
    read(mine);
    if (!mine.painter) return;
    const text = d.serverResponse, end = text.lastIndexOf(VIEW_END);
    const view = text.slice(mine.seen, end < mine.seen ? text.length : end);
    mine.painter.finish();
    // htmx saves the page for its history, then swaps, in this same task: nothing of this is painted between.
    putBack(mine);
    if (view.includes('id="inspect-view"')) {
      d.serverResponse = view;
    } else {
      // The capture stopped after its first layers (the model busy, a store too full): its error box in the
      // page's banner, as a refusal's; no swap, no new address.
      d.shouldSwap = false;
      const area = document.getElementById("error");
      if (area) area.innerHTML = view;
    }
  });
  /* The answer broke off (the connection lost) or was dropped for another: the view before comes back. */
  document.addEventListener("htmx:afterRequest", (e) => {
    const d = e.detail;
    if (!run || d.xhr !== run.xhr) return;
    const mine = run;
    run = null;
    if (!mine.painter) return;
    mine.painter.finish();
    putBack(mine);
    // Broken off (done, nothing to read: no status) rather than dropped (an abort leaves the request unsent).
    if (d.xhr.readyState === 4 && d.xhr.status === 0) kv.showError(kv.t("js.inspect.climb_lost"));
  });
})();
