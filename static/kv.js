/* Small helpers shared by KVScope pages. */
(function () {
  "use strict";
  const kv = (window.kv = window.kv || {});
  let strings = null;

  /* A UI string from the server's translation catalog ("js." keys), with {name} placeholders filled. */
  kv.t = function (key, vars) {
    if (strings === null) {
      const el = document.getElementById("i18n-strings");
      strings = el ? JSON.parse(el.textContent) : {};
    }
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
  /* Fetch JSON; on an error status, show the server's message in #error and throw. */
  kv.getJSON = async function (url) {
    const r = await fetch(url);
    let body = null;
    try { body = await r.json(); } catch (e) { body = null; }
    if (!r.ok) {
      kv.showError((body && body.detail) || kv.t("js.error.request_failed", { status: r.status }));
      throw new Error("HTTP " + r.status);
    }
    return body;
  };
  kv.showError = function (message) {
    const area = document.getElementById("error");
    if (!area) return;
    area.textContent = "";
    const box = document.createElement("div");
    box.className = "error-box";
    const b = document.createElement("b");
    b.textContent = kv.t("js.error.prefix") + " ";
    box.appendChild(b);
    box.appendChild(document.createTextNode(message)); // always text, never HTML
    area.appendChild(box);
  };
  kv.fmt = function (x, d) {
    if (x === null || x === undefined) return "—";
    if (!isFinite(x)) return x > 0 ? "+∞" : "−∞";
    return Number(x).toFixed(d === undefined ? 4 : d);
  };
  kv.plotFont = { size: 15, family: "system-ui, sans-serif" };
  /* Resolves once Plotly is there. Pages may load its 4.8 MB bundle with async (id="plotly-js"), so
     data can be fetched and the canvas grid drawn while the browser is still parsing it. */
  kv.plotlyReady = function () {
    return new Promise((resolve) => {
      if (window.Plotly) return resolve(window.Plotly);
      const tag = document.getElementById("plotly-js");
      if (!tag) return resolve(window.Plotly);
      tag.addEventListener("load", () => resolve(window.Plotly), { once: true });
    });
  };
  /* Attention weights: white (0) to dark blue (1); masked cells show the tan plot background. */
  kv.WEIGHT_SCALE = [[0, "#ffffff"], [0.25, "#9ecae1"], [0.6, "#3182bd"], [1, "#08306b"]];
  kv.MASK_COLOUR = "#e8d9b5";

  /* Every chart's toolbar (all pages, whatever config a page passes): the camera button saves a PNG, one
     more button saves an SVG, both through Plotly's own Plotly.downloadImage. */
  kv.plotlyReady().then(function (P) {
    if (!P || !P.setPlotConfig) return;
    P.setPlotConfig({
      toImageButtonOptions: { format: "png", filename: "kvscope", scale: 2 },
      modeBarButtonsToAdd: [{
        name: "kvscope-svg", title: kv.t("js.classroom.svg"), icon: P.Icons.disk || P.Icons.camera,
        click: function (gd) { P.downloadImage(gd, { format: "svg", filename: "kvscope" }); },
      }],
    });
  });
})();
