/* Inspect while its prompt is captured: each layer's attention as soon as the model has computed it. The server
   streams one part per layer into the page it is still sending (app/web/render.py render_in_parts, app/labs/
   inspect.py page_in_parts): <script type="application/json" class="kv-layer"> then <i class="kv-layer-end">.
   This script runs as the page is parsed (not deferred: the page's other scripts run once it is all there), so it
   watches the parser add them: the layer's row of the all-heads grid, the status line, and the first head's
   matrix drawn from the first layer that has it. The bytes are the finished trace's (grid: round(255·√w)
   max-pooled; a head: the first paint's sqrt-u8), so nothing drawn here is replaced by other numbers; inspect.js
   takes them over (window.kv.climb) once the view has arrived. A capture that stops leaves this block hidden
   with the page's pending line (style.css: once .view-end is parsed). */
(function () {
  "use strict";
  const kv = (window.kv = window.kv || {});
  const box = document.getElementById("climb");
  if (!box) return;
  const root = document.getElementById("capture-pending"), line = document.getElementById("climb-line");
  const H = +box.dataset.heads, L = +box.dataset.layers;
  const want = box.dataset.layer === "" ? null : `${box.dataset.layer}/${box.dataset.head || 0}`;
  const scale = new URL(window.location.href).searchParams.get("scale");
  const f = (kv.SCALES[scale] || kv.SCALES.sqrt).f;
  const climb = (kv.climb = { key: box.dataset.key, layers: {}, heads: {}, side: 0, n_layer: L, n_head: H,
    drawn: null, picked: null, done: false });
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
    const heat = document.getElementById("climb-heat");
    heat.replaceChildren(c);
    document.getElementById("climb-head-label").textContent =
      box.dataset.headLabel.replace("{layer}", m.layer).replace("{head}", m.head);
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

  /* A ready cell clicked: the head the view opens on when the capture is done (nothing is drawn before: its matrix
     is the finished trace's to send). */
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

  const watch = new MutationObserver((records) => {
    for (const r of records) {
      for (const node of r.addedNodes) {
        if (node.nodeType !== 1) continue;
        if (node.classList.contains("kv-layer-end")) {
          const script = node.previousElementSibling;
          if (script && script.classList.contains("kv-layer")) apply(JSON.parse(script.textContent));
        } else if (node.classList.contains("view-end")) {
          // The view (or its error) is in: the climb goes, its ids (the token strip's) with it; what it drew
          // stays in kv.climb for inspect.js. A capture that stopped leaves nothing of it.
          climb.done = true;
          root.classList.remove("climbing");
          box.remove();
          watch.disconnect();
        }
      }
    }
  });
  watch.observe(root.parentNode, { childList: true, subtree: true });
})();
