/* Inspect's first paint of one head, before Plotly has loaded (it loads once the reader moves, or after a few
   quiet seconds): the cells on a canvas, one pixel per cell, inside the frame Plotly will draw around them — the
   same margins, axis titles, token or position labels and colour bar — so the first picture already reads as a
   chart (a projector's audience sees axes at once) and Plotly's picture replaces it where it stands.

   Every position is a fraction of the box (CSS calc), so the frame follows the box if the window changes size.

        ┌ margin.t (+ a phone's colour bar, above the cells) ───────────────┐
        │ y labels │ cells (the canvas, stretched)          │ colour bar   │
        │ y title  │                                        │ (not phones) │
        └ x labels, x title: margin.b ──────────────────────────────────────┘          */
(function () {
  "use strict";
  const kv = window.kv;
  const FONT = 15, LINE = 18;                  // Plotly's size for kv.plotFont, and its line
  const BAR = { right: 110, top: 115 };        // room Plotly's colour bar takes: at the right, or (phones) above

  /* Plotly's automatic tick step: about one label per minPx pixels (4 to 9 of them), rounded up to 2, 5 or 10 × 10^k. */
  function step(range, count) {
    const rough = range / count, base = Math.pow(10, Math.floor(Math.log10(rough))), m = rough / base;
    return (m <= 2 ? 2 : m <= 5 ? 5 : 10) * base;
  }
  const ticksFor = (range, px, minPx) => step(range, Math.min(9, Math.max(4, px / minPx)) + 1);
  const tidy = (v) => String(+v.toPrecision(6)).replace("-", "−");

  /* o: { canvas, cols, rows, q (the query row framed), margin: {l, r, t, b}, boxWidth, boxHeight, labels (a token per
     position, or null for numbers), xTitle, yTitle, bar: { title, stops: [[0…1, css colour]], lo, hi }, narrow }.
     Returns the frame, to put in the empty box. */
  kv.heatFrame = function (o) {
    const frame = kv.el("div", { class: "heat-frame" });
    const m = Object.assign({}, o.margin);
    if (o.narrow) m.t += BAR.top; else m.r += BAR.right;
    // An x title wider than the cells breaks into lines, each a line more of bottom margin (kv.js does so for Plotly).
    const room = Math.max(60, (o.boxWidth || 600) - m.l - m.r) - 8;
    m.b += 21 * (Math.ceil(kv.textWidth(o.xTitle, 18) / room) - 1);
    // A point at fraction f of the cells' width or height, from the box's left or top edge.
    const X = (f) => `calc(${m.l}px + ${f} * (100% - ${m.l + m.r}px))`;
    const Y = (f) => `calc(${m.t}px + ${f} * (100% - ${m.t + m.b}px))`;
    const add = (cls, text, css) => {
      const e = kv.el("div", { class: cls }, text);
      Object.assign(e.style, css);
      frame.appendChild(e);
      return e;
    };
    Object.assign(o.canvas.style, { left: X(0), top: Y(0), width: `calc(100% - ${m.l + m.r}px)`,
      height: `calc(100% - ${m.t + m.b}px)` });
    frame.appendChild(o.canvas);

    // Ticks: every position's token while they fit (x slanted up to its cell, as Plotly's -60°), else numbers.
    const fx = (i) => (i + 0.5) / o.cols, fy = (i) => (i + 0.5) / o.rows;
    const pick = (n, px, minPx) => {
      if (o.labels) return [...Array(n).keys()];
      const d = ticksFor(n, px, minPx), out = [];
      for (let v = 0; v < n; v += d) out.push(v);
      return out;
    };
    const box = { w: room + 8, h: Math.max(60, (o.boxHeight || 500) - m.t - m.b) };
    const text = (i) => (o.labels ? o.labels[i] : String(i));
    for (const i of pick(o.cols, box.w, 80)) {
      if (o.labels) {
        add("tick x slant", text(i), { right: `calc(100% - (${X(fx(i))}))`, top: `calc(${Y(1)} + ${12 - LINE / 2}px)` });
      } else {
        add("tick x", text(i), { left: X(fx(i)), top: `calc(${Y(1)} + 9px)`, transform: "translateX(-50%)" });
      }
    }
    let widest = 0;
    for (const i of pick(o.rows, box.h, 40)) {
      widest = Math.max(widest, kv.textWidth(text(i), FONT));
      add("tick y", text(i), { right: `calc(100% - ${m.l - 9}px)`, top: `calc(${Y(fy(i))} - ${LINE / 2}px)` });
    }
    // Axis titles: x centred under the labels, y turned up and left of them (as Plotly places them).
    add("title x", o.xTitle, { left: X(0.5), top: `calc(${Y(1)} + ${o.labels ? 53 : 34}px)`,
      transform: "translateX(-50%)", maxWidth: `calc(100% - ${m.l + m.r + 8}px)` });
    add("title y", o.yTitle, { left: Math.max(10.5, m.l - 9 - widest - 10 - 10.5) + "px", top: Y(0.5),
      transform: "translate(-50%, -50%) rotate(-90deg)" });
    // The chosen query's row framed, as Plotly's layout shape will frame it.
    add("row-mark", "", { left: X(0), top: Y(o.q / o.rows), width: `calc(100% - ${m.l + m.r}px)`,
      height: `calc((100% - ${m.t + m.b}px) / ${o.rows})` });
    colourBar(o, m, add, X, Y, box);
    return frame;
  };

  /* The colour bar: at the right of the cells, or above them on a phone (where kv.js puts Plotly's). */
  function colourBar(o, m, add, X, Y, box) {
    const b = o.bar, to = o.narrow ? "right" : "top";
    const stops = b.stops.map(([at, c]) => `${c} ${(100 * at).toFixed(2)}%`).join(", ");
    const at = (v) => (v - b.lo) / (b.hi - b.lo);
    const d = o.narrow ? step(b.hi - b.lo, 3) : ticksFor(b.hi - b.lo, box.h - 20, 40);
    const values = [];
    for (let v = Math.ceil(b.lo / d) * d; v <= b.hi + d * 1e-6; v += d) values.push(v);
    if (o.narrow) {
      const bx = (f) => `calc(${m.l + 10}px + ${f} * (100% - ${m.l + m.r + 20}px))`;
      add("bar", "", { left: bx(0), top: "77px", width: `calc(100% - ${m.l + m.r + 20}px)`, height: "12px",
        background: `linear-gradient(to ${to}, ${stops})` });
      values.forEach((v) => add("tick bar-tick", tidy(v), { left: bx(at(v)), top: "94px", transform: "translateX(-50%)" }));
      add("title bar-title", b.title, { left: X(0.5), top: "46px", transform: "translateX(-50%)" });
      return;
    }
    const left = `calc(100% - ${m.r - 18}px)`, by = (f) => `calc(${m.t + 10}px + ${f} * (100% - ${m.t + m.b + 20}px))`;
    add("bar", "", { left, top: by(0), width: "30px", height: `calc(100% - ${m.t + m.b + 20}px)`,
      background: `linear-gradient(to ${to}, ${stops})` });
    values.forEach((v) => add("tick bar-tick", tidy(v), { left: `calc(100% - ${m.r - 52}px)`, top: `calc(${by(1 - at(v))} - ${LINE / 2}px)` }));
    add("title bar-title", b.title, { left: `calc(100% - ${m.r - 88}px)`, top: Y(0.5),
      transform: "translate(-50%, -50%) rotate(-90deg)" });
  }
})();
