/* The attention weights' colours: one scale (white 0 to dark blue 1), linear, √ and log mappings onto it, and the
   masked cells' tan. */
(function () {
  "use strict";
  const kv = (window.kv = window.kv || {});
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
  /* A weight sent as one byte for drawing, round(255·√w) (app/viz/attention.py sqrt_u8: a head's first paint, the
     grid, the layers streamed during a capture), back to a weight: (b / 255)². */
  kv.fromSqrtU8 = (b) => (b / 255) * (b / 255);
  kv.MASK_COLOUR = "#e8d9b5";
  kv.MASK_RGB = [0xe8, 0xd9, 0xb5];
})();
